"""The GPU measuring scripts (scripts/gpu) in their --dry-run mode, and iadeep's real
commands reading what they write: `iadeep memory eval`, `iadeep sim --gavel`,
`iadeep predictor eval`, and for the end-to-end script a real `iadeep up --no-nvml`
cluster with jobs started by `iadeep run`.

The dry run's backend is synthetic (documented formulas, no torch, no GPU), so these
tests check the pipeline and the file formats, never a measured figure.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from conftest import DEADLINE_S, IADEEP, REPO

SCRIPTS = REPO / "scripts" / "gpu"


def script(name: str, *args: str, check: bool = True, timeout: float = DEADLINE_S) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / name), *args], capture_output=True, text=True, timeout=timeout,
        env=dict(os.environ, IADEEP_BIN=str(IADEEP)),
    )
    if check and result.returncode != 0:
        raise AssertionError(f"{name} {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def iadeep_json(*args: str) -> Dict:
    """Runs `iadeep ARGS --json` and returns the JSON object on its last line."""
    result = subprocess.run([str(IADEEP), *args, "--json"], capture_output=True, text=True, timeout=DEADLINE_S)
    assert result.returncode == 0, f"iadeep {' '.join(args)} failed:\n{result.stderr}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def rows(path: Path) -> List[Dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_every_script_has_help_that_names_the_synthetic_dry_run():
    for name in ("measure_memory.py", "measure_interference.py", "e2e.py", "train_job.py"):
        out = script(name, "--help").stdout
        assert "usage:" in out and ("SYNTHETIC" in out or "synthetic" in out), out


def test_memory_dry_run_is_read_by_memory_eval(tmp_path: Path):
    out = tmp_path / "memory"
    script("measure_memory.py", "--dry-run", "--out", str(out), "--models",
           "resnet18,resnet50,vgg16,vit_small_patch16_224,lm-small,gpt2-small-s512")
    meta = json.loads((out / "SYNTHETIC-memory-metadata.json").read_text())
    assert meta["backend"] == "synthetic" and "NOT measurements" in meta["note"]
    full = rows(out / "SYNTHETIC-memory-full.csv")
    assert all(r["model"].startswith("synthetic-") for r in full)
    # The synthetic card is 16 GiB: the largest sizes run out of memory, end their
    # model's ladder, and stay out of the three-column files.
    oom = {(r["model"], r["batch_size"]) for r in full if r["status"] == "oom"}
    assert oom
    for measure in ("reserved", "allocated", "nvml"):
        path = out / f"SYNTHETIC-memory-{measure}.csv"
        table = rows(path)
        assert not oom & {(r["model"], r["batch_size"]) for r in table}
        report = iadeep_json("memory", "eval", str(path), "--fit-upto", "64")
        assert report["models"] >= 1 and report["predictions"] >= report["models"], report
        assert report["cubic_baseline"]["predictions"] == report["predictions"] + report["refused"]


def test_memory_budget_stops_and_resume_completes_without_overwriting(tmp_path: Path):
    out = tmp_path / "memory"
    args = ["--dry-run", "--out", str(out), "--models", "resnet18,lm-small", "--batch-sizes", "2,4,8"]
    first = script("measure_memory.py", *args, "--budget-s", "0")
    assert "--resume" in first.stdout
    assert rows(out / "SYNTHETIC-memory-reserved.csv") == []
    refused = script("measure_memory.py", *args, check=False)
    assert refused.returncode != 0 and "--resume" in refused.stderr
    script("measure_memory.py", *args, "--resume")
    table = rows(out / "SYNTHETIC-memory-reserved.csv")
    assert [(r["model"], r["batch_size"]) for r in table] == [
        (f"synthetic-{m}", str(b)) for m in ("resnet18", "lm-small") for b in (2, 4, 8)
    ]
    raw = (out / "SYNTHETIC-memory-raw.jsonl").read_text().splitlines()
    assert len(raw) == 6, "each point measured once"


def test_dry_runs_refuse_to_write_under_data_measured(tmp_path: Path):
    target = REPO / "data" / "measured" / "pytest-must-not-exist"
    for name in ("measure_memory.py", "measure_interference.py", "e2e.py"):
        result = script(name, "--dry-run", "--out", str(target), check=False)
        assert result.returncode != 0 and "data/measured" in result.stderr, (name, result.stderr)
        assert not target.exists()


def test_interference_dry_run_feeds_the_simulator_and_the_predictor_evaluation(tmp_path: Path):
    out = tmp_path / "interference"
    script("measure_interference.py", "--dry-run", "--out", str(out), "--triples", "4", "--jobs",
           "resnet18:32/128,lm-small:8/32,mobilenet_v3_large:32/128")
    gavel = json.loads((out / "SYNTHETIC-gavel-synthetic.json").read_text())
    jobs = gavel["synthetic"]
    key = "('synthetic-resnet18 (batch size 32)', 1)"
    assert jobs[key]["null"] > 0
    other = "('synthetic-lm-small (batch size 8)', 1)"
    assert jobs[key][other] == jobs[other][key][::-1], "both orders of a pair, mirrored"
    assert any(v == [0, 0] for entries in jobs.values() for k, v in entries.items() if k != "null"), \
        "pairs that ran out of memory are written as Gavel writes them"

    sim = iadeep_json(
        "sim", "--gavel", str(out / "SYNTHETIC-gavel-synthetic.json"), "--worker-type", "synthetic",
        "--gpu-mem-mib", "16384", "--tasks", "12", "--gpus", "2", "--load", "2", "--max-duration-h", "2",
        "--policies", "exclusive,packing,iadeep", "--out", str(tmp_path / "sim"),
    )
    assert set(sim["policies"]) == {"exclusive", "packing", "iadeep"}
    assert all(p["makespan_s"] > 0 for p in sim["policies"].values())

    samples_path = out / "SYNTHETIC-samples-synthetic.jsonl"
    samples = [json.loads(line) for line in samples_path.read_text().splitlines()]
    assert {len(s["corunners"]) for s in samples} == {1, 2}, "pairs and triples"
    assert all(s["synthetic"] and s["device"] == "synthetic" for s in samples)
    for split in ("default", "unseen-models"):
        report = iadeep_json("predictor", "eval", str(samples_path), "--seeds", "1", "--split", split)
        assert report["samples"] == len(samples), report

    summary = json.loads((out / "SYNTHETIC-interference-summary.json").read_text())
    triples = rows(out / "SYNTHETIC-interference-triples.csv")
    compared = [r for r in triples if r["relative_error"]]
    assert summary["product_of_pairs_on_triples"]["jobs_compared"] == len(compared) > 0
    for r in compared:
        expected = float(r["product_of_pairs"]) / float(r["measured_slowdown"]) - 1
        assert abs(float(r["relative_error"]) - expected) < 1e-3


def test_interference_resume_measures_only_what_is_missing(tmp_path: Path):
    out = tmp_path / "interference"
    args = ["--dry-run", "--out", str(out), "--jobs", "resnet18:32,lm-small:8/32,mobilenet_v3_large:32", "--triples", "1"]
    script("measure_interference.py", *args, "--budget-s", "0")
    assert (out / "SYNTHETIC-interference-raw.jsonl").read_text() == ""
    script("measure_interference.py", *args, "--resume")
    raw = [json.loads(line) for line in (out / "SYNTHETIC-interference-raw.jsonl").read_text().splitlines()]
    # 4 solos, 10 pairs (4 with themselves), 1 triple; each once.
    assert sorted(len(r["jobs"]) for r in raw) == [1] * 4 + [2] * 10 + [3]
    again = script("measure_interference.py", *args, "--resume")
    assert "0 to measure" in again.stdout


def test_e2e_dry_run_drives_three_policies_and_a_real_iadeep_cluster(tmp_path: Path):
    memory = tmp_path / "memory"
    script("measure_memory.py", "--dry-run", "--out", str(memory), "--models", "resnet18,resnet50,mobilenet_v3_large,"
           "vit_small_patch16_224,lm-small,efficientnet_b0", "--batch-sizes", "16,32,64")
    out = tmp_path / "e2e"
    script("e2e.py", "--dry-run", "--out", str(out), "--jobs", "3", "--steps-scale", "0.02", "--mean-gap-s", "0.2",
           "--iadeep", str(IADEEP), "--memory-csv", str(memory / "SYNTHETIC-memory-nvml.csv"),
           # Three policies and an `iadeep up` cluster, each step with its own generous wait.
           timeout=3 * DEADLINE_S)
    summary = json.loads((out / "SYNTHETIC-summary.json").read_text())
    assert "NOT measurements" in summary["note"]
    policies = summary["policies"]
    assert set(policies) == {"exclusive", "packing", "iadeep"}
    assert policies["exclusive"]["completed"] == 3 and policies["exclusive"]["oom_crashes"] == 0
    assert policies["iadeep"]["completed"] == 3
    jobs = rows(out / "iadeep" / "jobs.csv")
    assert all(float(j["completion_s"]) > 0 and j["model"].startswith("synthetic-") for j in jobs)
    # Every iadeep job went through the placer: its placement is in the store's history.
    events = (out / "iadeep" / "store-events.log").read_text()
    run = json.loads((out / "iadeep" / "run.json").read_text())
    for task in run["tasks"]:
        assert f"/iadeep/v1/tasks/{task}/placement" in events, task
    # `iadeep status --json` was watched while the jobs ran: one object per refresh.
    snapshots = [json.loads(line) for line in (out / "iadeep" / "status.jsonl").read_text().splitlines()]
    assert snapshots and all("devices" in snapshot for snapshot in snapshots), snapshots[:1]
    assignments = rows(out / "iadeep" / "assignments.csv")
    assert all(a["job"] and int(a["batch_size"]) > 0 for a in assignments)
    assert (out / "SYNTHETIC-assignments.svg").read_text().startswith("<svg")


def test_the_gpu_probe_reads_nvidia_smi_and_names_the_kind_as_iadeep_does(tmp_path: Path, monkeypatch):
    # A stand-in for the driver's tool (no GPU here): fixed answers per query.
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text(
        "#!/bin/sh\n"
        'case "$*" in\n'
        '  *--query-gpu=name,driver_version,memory.total,uuid*) echo "NVIDIA H100 80GB HBM3, 550.54.15, 81559, GPU-1";;\n'
        '  *--query-gpu=memory.used*) echo "1024";;\n'
        '  *--query-compute-apps=pid,used_memory*) echo "4242, 2048"; echo "77, 512";;\n'
        '  *--query-gpu=utilization.gpu,utilization.memory*) echo "87, 41";;\n'
        "  *) exit 2;;\n"
        "esac\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    monkeypatch.syspath_prepend(str(SCRIPTS))
    from gpubench.device import GpuProbe, kind_from_name

    probe = GpuProbe(0)  # the nvidia-smi path, whether or not pynvml is installed
    info = probe.info()
    assert (info["name"], info["driver_version"], info["memory_total_mib"], info["kind"]) == (
        "NVIDIA H100 80GB HBM3", "550.54.15", 81559, "h100")
    assert probe.used_mib() == 1024.0
    assert probe.process_used_mib(4242) == 2048.0
    assert probe.process_used_mib(1) is None, "a process NVML does not list"
    assert probe.utilization() == (87.0, 41.0)
    # The same names as tuner/src/daemon/device.rs's kind_from_name.
    assert [kind_from_name(n) for n in ("Tesla K80", "NVIDIA GeForce RTX 4090")] == ["k80", "4090"]


def test_measuring_without_torch_says_so_instead_of_failing_per_model(tmp_path: Path):
    # `python -S` leaves site-packages off the path: torch is not importable, installed or not.
    for name in ("measure_memory.py", "measure_interference.py", "e2e.py"):
        result = subprocess.run(
            [sys.executable, "-S", str(SCRIPTS / name), "--out", str(tmp_path / name)],
            capture_output=True, text=True, timeout=DEADLINE_S,
        )
        assert result.returncode != 0 and "torch is not importable" in result.stderr, (name, result.stderr)
