"""Result shards: merging unreadable or changed shards, and the judge's signing key."""

from __future__ import annotations


def test_merge_turns_an_unreadable_shard_into_a_crashed_row(tmp_path, scenarios):
    from kb_nano.kernels.merge import merge
    from kb_nano.kernels.schema import make_row, scenario_fields, write_rows

    scenario = scenarios["rms_norm__llama32-1b__tp1__n4"]
    shard_dir = tmp_path / "results/kernels/rms_norm"
    good = shard_dir / "good" / f"{scenario['scenario_id']}.parquet"
    write_rows([make_row(**scenario_fields(scenario), candidate="rms_norm/good", status="passed")], good)
    bad = shard_dir / "bad" / f"{scenario['scenario_id']}.parquet"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(good.read_bytes()[:100])
    rows = merge([good, bad], [], tmp_path / "k.parquet", tmp_path / "k.json", scenarios)
    by = {r["candidate"]: r for r in rows}
    assert by["rms_norm/good"]["status"] == "passed"
    assert by["rms_norm/bad"]["status"] == "crashed" and "delete it and rerun" in by["rms_norm/bad"]["error"]


def test_merge_marks_shards_changed_after_the_judge_wrote_them(tmp_path, scenarios):
    from kb_nano.kernels.merge import merge
    from kb_nano.kernels.schema import make_row, read_signed, scenario_fields, write_rows
    from kb_nano.kernels.signing import key

    secret = key(tmp_path)
    assert (tmp_path / "results/.kb_nano/shard.key").stat().st_mode & 0o777 == 0o600 and key(tmp_path) == secret
    scenario = scenarios["rms_norm__llama32-1b__tp1__n4"]
    shards = {}
    for name in ("kept", "edited", "unsigned"):
        shards[name] = tmp_path / "results/kernels/rms_norm" / name / f"{scenario['scenario_id']}.parquet"
        row = make_row(**scenario_fields(scenario), candidate=f"rms_norm/{name}", status="incorrect", error="x")
        write_rows([row], shards[name], secret=None if name == "unsigned" else secret)
    rows, sig = read_signed(shards["edited"])
    rows[0].update(status="passed", error=None, speedup=50.0)  # forged after the judge wrote it, signature kept
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(rows, schema=pq.read_schema(shards["edited"]))
    pq.write_table(table, shards["edited"])
    by = {
        r["candidate"]: r
        for r in merge(list(shards.values()), [], tmp_path / "k.parquet", tmp_path / "k.json", scenarios, secret=secret)
    }
    assert by["rms_norm/kept"]["status"] == "incorrect"
    assert (
        by["rms_norm/edited"]["status"] == "tampered" and "signature does not match" in by["rms_norm/edited"]["error"]
    )
    assert (
        by["rms_norm/unsigned"]["status"] == "tampered" and "no judge's signature" in by["rms_norm/unsigned"]["error"]
    )


def test_shard_key_is_never_read_half_written(tmp_path):
    """Many processes asking for the key at once all get the same, whole key."""
    import multiprocessing

    from kb_nano.kernels.signing import key

    with multiprocessing.get_context("spawn").Pool(4) as pool:
        keys = pool.map(key, [tmp_path] * 16)
    assert len(set(keys)) == 1 and len(keys[0]) == 32
    assert [p.name for p in (tmp_path / "results/.kb_nano").iterdir()] == ["shard.key"]
