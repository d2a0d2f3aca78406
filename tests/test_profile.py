"""profile: NVML sampler arithmetic (fake handle), peaks, report merging, a CPU run producing the JSON."""

from __future__ import annotations

import json
import types

import pytest
import torch


class FakeNvml:
    """Two GPUs whose readings follow a script of samples."""

    NVML_CLOCK_SM = 1

    def __init__(self, script):
        self.script = script  # per GPU: list of (util, used, power_mW, clock, mask)
        self.calls = [0, 0]
        self.shutdown = False

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        self.shutdown = True

    def nvmlDeviceGetCount(self):
        return len(self.script)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA H100 80GB HBM3"

    def _row(self, h):
        return self.script[h][self.calls[h]]

    def nvmlDeviceGetUtilizationRates(self, h):
        return types.SimpleNamespace(gpu=self._row(h)[0], memory=0)

    def nvmlDeviceGetMemoryInfo(self, h):
        return types.SimpleNamespace(used=self._row(h)[1], total=80 * 2**30, free=0)

    def nvmlDeviceGetPowerUsage(self, h):
        return self._row(h)[2]

    def nvmlDeviceGetClockInfo(self, h, kind):
        assert kind == self.NVML_CLOCK_SM
        return self._row(h)[3]

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
        mask = self._row(h)[4]
        self.calls[h] += 1  # last reading of a sample
        return mask


def test_sampler_arithmetic_against_fake_nvml():
    from megatron_lol.perf.gpu_monitor import GpuSampler, decode_throttle

    script = [
        [
            (100, 10 * 2**30, 700_000, 1980, 0),
            (80, 12 * 2**30, 650_000, 1700, 0x4),
            (90, 11 * 2**30, 600_000, 1800, 0x4 | 0x20),
        ],
        [(50, 1 * 2**30, 300_000, 1500, 0x1), (70, 2 * 2**30, 400_000, 1600, 0), (60, 3 * 2**30, 500_000, 1700, 0)],
    ]
    nv = FakeNvml(script)
    s = GpuSampler(nvml=nv, interval=0.01)
    for _ in range(3):
        s.sample_once()
    out = s.stop()
    assert nv.shutdown
    g0, g1 = out["gpus"]
    assert g0["samples"] == 3 and g0["name"] == "NVIDIA H100 80GB HBM3"
    assert g0["utilization_pct"] == {"mean": 90.0, "min": 80.0, "max": 100.0}
    assert g0["power_w"]["mean"] == pytest.approx(650.0) and g0["power_w"]["min"] == pytest.approx(600.0)
    assert g0["sm_clock_mhz"]["min"] == 1700 and g0["sm_clock_mhz"]["mean"] == pytest.approx(1826.6667, rel=1e-4)
    assert g0["memory_used_bytes"]["max"] == 12 * 2**30
    assert g0["throttle_reasons"] == {"sw_power_cap": pytest.approx(2 / 3), "sw_thermal_slowdown": pytest.approx(1 / 3)}
    assert g1["throttle_reasons"] == {"gpu_idle": pytest.approx(1 / 3)}
    assert g1["power_w"]["mean"] == pytest.approx(400.0)
    assert decode_throttle(0x8 | 0x40) == ["hw_slowdown", "hw_thermal_slowdown"]
    # the background thread samples and stops
    nv2 = FakeNvml([[(1, 1, 1000, 1, 0)] * 10000])
    t = GpuSampler(nvml=nv2, interval=0.001).start()
    import time

    time.sleep(0.05)
    res = t.stop()
    assert res["gpus"][0]["samples"] >= 1


def test_sampler_not_started_without_gpus():
    from megatron_lol.perf.gpu_monitor import start_if_available

    if not torch.cuda.is_available():
        assert start_if_available() is None


def test_peaks_table_and_override():
    from megatron_lol.perf.peaks import lookup_peak, mfu, peak_tflops

    assert lookup_peak("NVIDIA H100 80GB HBM3").name == "H100 SXM"
    assert lookup_peak("NVIDIA H100 PCIe").name == "H100 PCIe"
    assert lookup_peak("NVIDIA H800").bf16 == pytest.approx(989.4)
    assert lookup_peak("NVIDIA H200").fp8 == pytest.approx(1978.9)
    assert lookup_peak("NVIDIA A100-SXM4-80GB").bf16 == 312.0
    assert lookup_peak("cpu") is None and peak_tflops(None) is None
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "fp8") is None
    assert peak_tflops(None, override=123.0) == 123.0
    assert mfu(494.7, 989.4) == pytest.approx(0.5) and mfu(1.0, None) is None


def _node(host, step, tps, tfl, mfu, clock=None):
    gpus = [] if clock is None else [{"samples": 3, "sm_clock_mhz": {"min": clock}, "utilization_pct": {"min": 50}}]
    return {
        "host": host,
        "step_time_s": step,
        "tokens_per_s_per_node": tps,
        "tflops_per_device": tfl,
        "mfu": mfu,
        "peak_memory_bytes": 2**30,
        "gpus": gpus,
    }


def test_merge_reports():
    from megatron_lol.errors import CliError
    from megatron_lol.training.profile import format_nodes, merge_reports

    a = {"nodes": [_node("n1", 1.0, 1000.0, 100.0, 0.1, 1900)]}
    b = {"nodes": [_node("n0", 2.0, 500.0, 50.0, 0.05, 1500), _node("n2", 1.0, 1000.0, 100.0, 0.1, 1980)]}
    m = merge_reports([a, b])
    assert [n["host"] for n in m["nodes"]] == ["n0", "n1", "n2"]
    s = m["summary"]
    assert s["nodes"] == 3 and s["tokens_per_s_total"] == 2500.0
    assert s["tflops_per_device_mean"] == pytest.approx(250 / 3) and s["tflops_per_device_min"] == 50.0
    assert s["mfu_min"] == 0.05 and s["slowest_node"] == "n0" and s["gpu_sm_clock_mhz_min"] == 1500
    assert "n0" in format_nodes(m)
    with pytest.raises(CliError):
        merge_reports([{"loss": 1}])


def _tiny_yaml(tmp_path, extra: str = "") -> str:
    path = tmp_path / "tiny.yaml"
    path.write_text(
        "model:\n  plan: lol\n  hidden_size: 32\n  num_attention_heads: 4\n  ffn_hidden_size: 64\n"
        "  n_prelude: 1\n  n_coda: 1\n  num_blocks: 3\n  routed_depth: 4\n  window_size: 8\n  window_shift: 4\n"
        "  vocab_size: 128\n"
        + extra
        + "training:\n  train_iters: 4\n  micro_batch_size: 2\n  global_batch_size: 2\n  seq_length: 32\n"
    )
    return str(path)


def test_profile_cli_on_cpu_writes_json(tmp_path, capsys):
    from megatron_lol.cli import main

    out = tmp_path / "report.json"
    n_threads = torch.get_num_threads()
    try:
        rc = main(
            [
                "profile",
                "--config",
                _tiny_yaml(tmp_path),
                "--synthetic-data",
                "--steps",
                "2",
                "--warmup",
                "1",
                "--threads",
                "1",
                "--json",
                str(out),
            ]
        )
    finally:
        torch.set_num_threads(n_threads)
    assert rc == 0
    text = capsys.readouterr().out
    assert "tokens/s" in text and "MFU              -" in text and "distinct blocks per path" in text
    assert "host syncs/step" in text
    rep = json.loads(out.read_text())
    assert rep["steps"] == 2 and rep["mfu"] is None and rep["device"]["kind"] == "cpu"
    assert rep["tokens_per_step"] == 64 and rep["tokens_per_s_per_device"] > 0
    assert rep["flops_per_step"] > 0 and rep["flops_per_step_executed"] > rep["flops_per_step"] * 0.5
    b = rep["breakdown_s"]
    for key in (
        "prelude",
        "core",
        "core.blocks",
        "core.dispatch",
        "core.routing",
        "coda_head",
        "backward",
        "optimizer",
        "data",
    ):
        assert b[key] >= 0
    assert 0 < b["core.blocks"] <= b["core"]
    assert b["core.dispatch"] > 0  # the dispatch functions core.py calls are the ones timed
    r = rep["routing"]
    assert len(r["block_utilisation"]) == 4 and all(abs(sum(row) - 1) < 1e-6 for row in r["block_utilisation"])
    assert 1 <= r["distinct_blocks_per_path"] <= 3
    assert rep["peak_memory"]["bytes"] > 0 and rep["gpu"] is None
    assert len(rep["nodes"]) == 1 and rep["nodes"][0]["tokens_per_s_per_node"] > 0
    # and the merge verb on it
    merged = tmp_path / "merged.json"
    assert main(["profile", "--merge", str(out), str(out), "--json", str(merged)]) == 0
    assert json.loads(merged.read_text())["summary"]["nodes"] == 2


def test_profile_errors(tmp_path):
    from megatron_lol.cli import main

    assert main(["profile", "--merge", str(tmp_path / "missing.json")]) == 2
    assert main(["profile", "--steps", "2"]) == 2  # neither --config nor --merge
    assert main(["profile", "--config", _tiny_yaml(tmp_path), "--synthetic-data", "--steps", "0"]) == 2


def _profiled(plan: dict, count_steps: int = 2, routed_core: str = "auto") -> dict:
    """``profile``'s timed steps, then its counted and routing steps, in this process: a tiny model with
    2 micro-batches per step (the loss and the balancing loss summed over them on the device)."""
    from megatron_lol.config import config_from_dict
    from megatron_lol.training.profile import build_trainer, profile_trainer

    model = dict(hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, n_prelude=1, n_coda=1, vocab_size=128)
    model.update(plan)
    cfg = config_from_dict(
        {
            "model": model,
            "parallel": {"routed_core": routed_core},
            "training": {"train_iters": 8, "micro_batch_size": 2, "global_batch_size": 4, "seq_length": 32},
            "optimizer": {"clip_grad": 1.0},
        }
    )
    trainer = build_trainer(cfg, synthetic=True)
    rep = profile_trainer(trainer, 2, 1, breakdown=False, count_steps=count_steps, routing_steps=1)
    return json.loads(json.dumps(rep))  # what --json writes


def test_profile_counts_the_host_syncs_of_its_steps(megatron_env):
    """Issue 36's acceptance: a dense step reads the loss and metrics once (one batched read) and the gradient
    norm once (megatron-core's clipping with the foreach stand-in), beside megatron-core's cross entropy's two
    boolean-mask writes; the grouped LoL step at most 2 more; routing statistics come from steps of their own."""
    dense = _profiled({"plan": "dense", "core_layers": 2, "dense_attention": "full"})
    lol = _profiled(
        {
            "plan": "lol",
            "num_blocks": 3,
            "routed_depth": 4,
            "window_size": 8,
            "window_shift": 4,
        },
        routed_core="grouped",
    )
    for rep in (dense, lol):
        hs = rep["host_syncs"]
        assert hs["steps"] == 2 and hs["ops_per_step"] > 500 and "OpCounter" in hs["method"]
        assert hs["by_name"].get("tolist") == 1.0  # the step's scalars: one read
        assert hs["by_name"].get("_local_scalar_dense") == 1.0  # the gradient norm
        assert sum(hs["by_name"].values()) == hs["per_step"]
        assert hs["host_reads_per_step"] > 0  # torch.optim's step counters: on the host on a GPU too
    assert dense["host_syncs"]["per_step"] <= 4
    assert lol["host_syncs"]["per_step"] <= dense["host_syncs"]["per_step"] + 2
    assert dense["routing"] is None and lol["routing"]["steps"] == 1 and "untimed" in lol["routing"]["source"]
    assert len(lol["block_utilisation_trainer"]) == 4  # the timed steps' own, from their one read
    from megatron_lol.training.profile import format_report

    assert "host syncs/step" in format_report(lol) and "untimed step(s) of its own" in format_report(lol)


def test_profile_keeps_its_timed_figures_when_counting_fails(megatron_env, monkeypatch):
    """A counter that cannot follow the step (e.g. a kernel library's tensor subclass) is reported, not fatal:
    the timed steps' report stands, and the routing steps are not run on a step left half done."""
    import megatron_lol.perf.host_syncs as host_syncs
    from megatron_lol.training.profile import format_report

    def broken(*args, **kwargs):
        raise RuntimeError("cannot follow this op")

    monkeypatch.setattr(host_syncs, "count_step_syncs", broken)
    rep = _profiled({"plan": "lol", "num_blocks": 3, "routed_depth": 4, "window_size": 8, "window_shift": 4})
    assert rep["host_syncs"] == {"error": "RuntimeError: cannot follow this op"} and rep["routing"] is None
    assert rep["tokens_per_s"] > 0 and len(rep["step_time_s"]["all"]) == 2
    assert "not counted: RuntimeError" in format_report(rep)
