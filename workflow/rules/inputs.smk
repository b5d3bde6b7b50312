# The scenario manifest (results/inputs/llm-<selection>.yaml), computed at parse time: regenerated
# only when its inputs (models, tp, num_tokens, dtype, context_lens, the config.json files,
# the operators' shape code, the transformers version) changed, otherwise read back (JSON
# syntax, < 1 s for 10,000 scenarios), or copied from the user cache when another working
# directory generated the same one. No checkpoint, so a dry run shows every kernel job up front.
try:
    MANIFEST_DATA, _how = kbw.manifest(Path("."), config, Path(MANIFEST))
except KbNanoError as exc:
    raise WorkflowError(f"kb-nano: {exc}") from None
if _how is not None:
    n_na = sum(not s["applicable"] for s in MANIFEST_DATA["scenarios"])
    source = " (from the user cache)" if _how == "cache" else ""
    logger.info(
        f"kb-nano: wrote {MANIFEST}{source}: {len(MANIFEST_DATA['scenarios'])} scenarios ({n_na} not applicable)"
    )
SCENARIOS = {s["scenario_id"]: s for s in MANIFEST_DATA["scenarios"]}
