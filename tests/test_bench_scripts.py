"""bench/overhead.py's bookkeeping (what bench/e2e.py prints too), on planted run directories: no run, no timing."""
import json, sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import overhead  # noqa: E402

PARTS = {"device": 0.060, "input": 0.010, "host": 0.020, "log": 0.005, "checkpoint": 0.0, "eval": 0.0}


def plant(d: Path, records: list[dict], timing: dict | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if timing is not None: (d / "timing.json").write_text(json.dumps(timing))
    return d


def launched(first_train_at: float = 7.0) -> dict:
    return {"wall_s": 20.0, "arrivals": [[0, "eval", 3.0], [1, "train", first_train_at]], "returncode": 0,
            "timed_out": False}


def test_fallback_drops_the_first_record_and_marks_missing_parts(tmp_path):
    "Without timing.json: the steady step is the mean past step 1 (which holds the compile), parts are unknown."
    recs = [{"step": 1, "kind": "train", "timing/step": 30.0}, {"step": 2, "kind": "train", "timing/step": 0.2},
            {"step": 3, "kind": "train", "timing/step": 0.4}, {"step": 3, "kind": "eval", "loss": 1.0}]
    row = overhead.summarize("sft", launched(), plant(tmp_path / "r", recs))
    assert abs(row["step/step"] - 0.3) < 1e-12
    assert row["first_step_s"] == 7.0 and row["steps_done"] == 3 and not row["timing_json"]
    assert row["step/device"] is None and "host_pct" not in row
    assert row["first_sum_ok"] is None and row["step_sum_ok"] is None
    assert overhead.table([("sft", row)]).endswith("| sft | 20 | 7 | 7 | — | — | — | — | — | — | — | — | — | — | — | — | — | 300 | — | — | — | — | 0 |")


def test_timing_json_wins_and_host_overhead_is_wall_minus_device(tmp_path):
    first = {"startup": 2.0, "data": 1.0, "backend": 0.0, "weights": 0.5, "compile": 4.0, "compiles": 3, "memory_check": 0.3,
             "first_eval": 1.9, "resume": 0.0, "logger": 0.0, "first_run": 0.1, "total": 10.0}
    timing = {"first_step": first, "steps": {"step": 0.1, **PARTS}, "steps_timed": 19}
    recs = [{"step": s, "kind": "train", "timing/step": 9.0, "mfu": 0.25} for s in (1, 2, 3)]
    row = overhead.summarize("rl", launched(), plant(tmp_path / "r", recs, timing))
    assert row["first_step_s"] == 10.0 and row["first_step_seen_s"] == 7.0 and row["compiles"] == 3
    assert row["step/step"] == 0.1 and row["step/steps_timed"] == 19 and row["step/mfu"] == 0.25
    assert abs(row["host_ms"] - 40.0) < 1e-9 and abs(row["host_pct"] - 40.0) < 1e-9
    assert row["first_sum_ok"] is True and row["step_sum_ok"] is False      # 9.8 of 10 s; 0.095 of 0.1 s (5 % off: no)
    assert row["first_seen_ok"] is False                                     # 10 s by the run's clock, 7 s seen


def test_timing_json_keys_with_prefix_and_a_part_of_the_kinds_own(tmp_path):
    "maxpost writes `steps` as timing/<part>; a part beyond STEP_PARTS (RL's rewards) is added; `other` is not."
    first = {"startup": 2.0, "data": 1.0, "backend": 0.0, "weights": 0.5, "compile": 4.0, "compiles": 3, "memory_check": 0.3,
             "first_eval": 1.0, "resume": 0.0, "logger": 0.0, "first_run": 0.0, "other": 1.2, "total": 10.0}
    steps = {"timing/step": 0.1, **{f"timing/{k}": v for k, v in PARTS.items()}, "timing/rewards": 0.005}
    row = overhead.summarize("rl", launched(), plant(tmp_path / "r", [], {"first_step": first, "steps": steps}))
    assert row["step/rewards"] == 0.005 and row["step/device"] == 0.060 and row["first/other"] == 1.2
    assert row["step_sum_ok"] is True and row["first_sum_ok"] is False     # 8.8 of 10 s named: 12 % unexplained


def test_per_record_parts_when_timing_json_is_absent(tmp_path):
    recs = [{"step": s, "kind": "train", "timing/step": 0.1, **{f"timing/{k}": v for k, v in PARTS.items()}}
            for s in (1, 2)]
    recs[0]["timing/device"] = 5.0                     # step 1's device time (compilation) stays out of the mean
    row = overhead.summarize("dpo", launched(), plant(tmp_path / "r", recs))
    assert row["step/device"] == 0.060 and abs(row["host_ms"] - 40.0) < 1e-9


def test_adds_up_within_five_percent():
    assert overhead.adds_up(1.0, [0.5, 0.46]) is True
    assert overhead.adds_up(1.0, [0.5, 0.44]) is False
    assert overhead.adds_up(1.0, [0.5, 0.56]) is False
    assert overhead.adds_up(1.0, [0.5, None]) is None and overhead.adds_up(None, [1.0]) is None


def test_new_records_leaves_a_half_written_line(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1}\n{"step": 2')
    recs, seen = overhead.new_records(p, 0)
    assert recs == [{"step": 1}] and seen == len('{"step": 1}\n')
    with p.open("a") as f: f.write("}\n")
    assert overhead.new_records(p, seen)[0] == [{"step": 2}]


def test_rl_dpo_eval_load_the_sft_run(tmp_path):
    for kind in ("rl", "dpo", "eval"):
        assert f"load_parameters_path={tmp_path / 'ovh-sft'}" in overhead.command_args(kind, tmp_path, quick=True)
    assert not any(a.startswith("load_parameters_path") for a in overhead.command_args("sft", tmp_path, quick=False))


def test_median_rows_per_command():
    rows = [[{"kind": "sft", "wall_s": w, "timed_out": False}] for w in (3.0, 1.0, 2.0)]
    assert overhead.median_rows(rows) == [{"kind": "sft", "wall_s": 2.0, "timed_out": False}]


FAKE_CLI = '''import json, sys, time
from pathlib import Path
kv = dict(a.split("=", 1) for a in sys.argv[2:])
d = Path(kv["base_output_directory"]) / kv["run_name"]; d.mkdir(parents=True, exist_ok=True)
if sys.argv[1] != "eval":
    first = {"startup": 1.0, "data": 1.0, "backend": 0.0, "weights": 1.0, "compile": 1.0, "compiles": 2, "memory_check": 0.5,
             "first_eval": 0.5, "resume": 0.0, "logger": 0.0, "first_run": 0.0, "total": 5.0}
    (d / "timing.json").write_text(json.dumps({"first_step": first, "steps": {"step": 0.5, "device": 0.3, "input": 0.1,
        "host": 0.1, "log": 0.0, "checkpoint": 0.0, "eval": 0.0}, "steps_timed": 2}))
    with (d / "metrics.jsonl").open("a") as f:
        for s in (1, 2, 3): f.write(json.dumps({"step": s, "kind": "train", "timing/step": 0.5}) + "\\n"); f.flush()
'''


def test_before_after_rounds_on_a_stand_in_checkout(tmp_path):
    "main() with --before/--after runs every kind per checkout per round, reads each run, and writes the table."
    for name in ("old", "new"):
        (tmp_path / name / "maxpost").mkdir(parents=True)
        (tmp_path / name / "maxpost" / "__init__.py").write_text("")
        (tmp_path / name / "maxpost" / "cli.py").write_text(FAKE_CLI)
    out = tmp_path / "overhead.json"
    overhead.main(["--before", str(tmp_path / "old"), "--after", str(tmp_path / "new"), "--rounds", "2", "--quick",
                   "--out", str(out)])
    res = json.loads(out.read_text())
    assert [len(res["all_rounds"][k]) for k in ("before", "after")] == [2, 2]
    sft = res["median"]["after"][0]
    assert sft["kind"] == "sft" and sft["first_step_s"] == 5.0 and sft["compiles"] == 2 and sft["steps_done"] == 3
    assert sft["first_sum_ok"] is True and sft["step_sum_ok"] is True and abs(sft["host_pct"] - 40.0) < 1e-9
    rows = [l.split(" | ")[0] for l in res["table"].splitlines()[2:]]
    assert rows == ["| sft before", "| sft after", "| rl before", "| rl after", "| dpo before", "| dpo after",
                    "| eval before", "| eval after"]


def test_a_command_past_its_box_is_stopped_and_keeps_its_records(tmp_path):
    "launch() sends SIGTERM at the box; the records written before it are still read."
    co = tmp_path / "co" / "maxpost"; co.mkdir(parents=True)
    (co / "__init__.py").write_text("")
    (co / "cli.py").write_text('import json, sys, time\nfrom pathlib import Path\nd = Path(sys.argv[1]); d.mkdir()\n'
                               '(d / "metrics.jsonl").write_text(json.dumps({"step": 1, "kind": "train"}) + "\\n")\n'
                               'time.sleep(600)\n')
    run = tmp_path / "run"
    res = overhead.launch(co.parent, [str(run)], run, tmp_path / "log", timeout=3.0)
    assert res["timed_out"] and res["returncode"] == -15 and [a[:2] for a in res["arrivals"]] == [[1, "train"]]
