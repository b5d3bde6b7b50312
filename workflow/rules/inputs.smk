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
    from kb_nano.kernels.manifest import written_note

    logger.info(written_note(MANIFEST, MANIFEST_DATA, _how))
SCENARIOS = {s["scenario_id"]: s for s in MANIFEST_DATA["scenarios"]}
