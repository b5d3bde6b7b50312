# The scenario manifest (results/inputs/llm.yaml), computed at parse time: regenerated
# only when its inputs (models, tp, num_tokens, dtype, context_lens, the config.json files,
# the operators' shape code) changed, otherwise read back (JSON syntax, < 1 s for 10,000
# scenarios). No checkpoint, so a dry run shows every kernel job up front.
try:
    MANIFEST_DATA, _regenerated = kbw.manifest(Path("."), config, Path(MANIFEST))
except KbNanoError as exc:
    raise WorkflowError(f"kb-nano: {exc}") from None
if _regenerated:
    n_na = sum(not s["applicable"] for s in MANIFEST_DATA["scenarios"])
    logger.info(
        f"kb-nano: wrote {MANIFEST}: {len(MANIFEST_DATA['scenarios'])} scenarios ({n_na} not applicable)"
    )
SCENARIOS = {s["scenario_id"]: s for s in MANIFEST_DATA["scenarios"]}
