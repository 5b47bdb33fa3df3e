"""experiments/benchmarks/bench_kernels.py: its flags, and a small run on the CPU.

The run (`--scale 16`: one block, about 182k parameters) times every kernel group and
checks that each row has positive seconds and bytes, that the copy bound is positive,
and that low_precision's one-device check passed with the exchange "auto" resolves to on
a CPU in one process: an all-to-all and an all-gather of the 16-bit patterns for bfloat16,
a float16 psum for float16.
"""

import json
import math

import pytest
from test_experiments import check_provenance, import_script, main_in_process, run

SCRIPT = "bench_kernels.py"


def test_the_gradient_is_gpt2_smalls():
    shapes = import_script(SCRIPT).gpt2_shapes(1)
    assert len(shapes) == 148 and sum(map(math.prod, shapes.values())) == 124_439_808
    assert shapes["wte"] == (50257, 768) and shapes["h.11.mlp.c_proj.w"] == (3072, 768)
    small = import_script(SCRIPT).gpt2_shapes(16)  # every dimension / 16, one block
    assert len(small) == 16 and small["wte"] == (3142, 48) and small["h.0.mlp.c_fc.b"] == (192,)


def test_help_lists_the_flags(monkeypatch, capsys):
    assert main_in_process(SCRIPT, "--help", monkeypatch=monkeypatch) == 0
    shown = capsys.readouterr().out
    for flag in ("--scale", "--kernels", "--densities", "--ranks", "--senders", "--repeats"):
        assert flag in shown
    assert "python experiments/benchmarks/bench_kernels.py" in shown and "(default:" in shown


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kernels", "terngrad,nope"], "unknown kernel group(s): nope"),
        (["--densities", "0.01,2"], "every density must be in (0, 1]"),
        (["--senders", "0"], "must be at least 1"),
    ],
)
def test_bad_arguments_exit_with_a_message(args, message, tmp_path, monkeypatch, capsys):
    code = main_in_process(SCRIPT, *args, "--out", str(tmp_path), monkeypatch=monkeypatch)
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not list(tmp_path.glob("*.json"))


@pytest.mark.slow
def test_every_kernel_has_a_time_and_bytes_and_low_precision_checks(tmp_path):
    flags = ["--platform", "cpu", "--scale", "16", "--repeats", "2", "--densities", "0.01"]
    result = run(SCRIPT, *flags, "--ranks", "2", "--quiet", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "jax.devices(): [CpuDevice(id=0)]" in result.stdout
    study = json.loads((tmp_path / "bench_kernels.json").read_text())
    check_provenance(study["provenance"], devices=1, seeds=[0])
    assert study["complete"] and study["platform"] == "cpu"
    assert study["params"] == sum(map(math.prod, study["leaves"].values()))
    assert study["copy"]["seconds"] > 0 and study["copy"]["gb_per_second"] > 0
    rows = {r["kernel"]: r for r in study["rows"]}
    expected = {
        "terngrad compress", "terngrad decompress", "decode d=0.01", "adasum pair",
        *(f"topk {s} d=0.01 {layout}" for s in ("sampled", "exact")
          for layout in ("per leaf", "concatenated")),
        "powersgd compress r2", "powersgd decompress r2",
        *(f"low_precision {phase} {dtype}" for phase in ("compress", "decompress", "update")
          for dtype in ("bf16", "f16")),
    }  # fmt: skip
    assert set(rows) == expected
    for r in rows.values():
        assert r["seconds"] > 0 and r["bytes"] > 0 and r["formula"], r
        assert r["gb_per_second"] > 0 and r["time_over_bound"] > 0, r
    p = study["params"]
    assert rows["low_precision compress bf16"]["bytes"] == 6 * p
    assert rows["adasum pair"]["bytes"] == 20 * p
    checks = {c["dtype"]: c for c in study["low_precision_check"]}
    assert set(checks) == {"bf16", "f16"} and all(c["passed"] for c in checks.values())
    assert all(c["max_abs_error"] == 0 and not c["overflow"] for c in checks.values())
    assert checks["f16"]["exchange"] == "psum" and checks["f16"]["native_16bit_psum"]
    assert checks["bf16"]["exchange"] != "psum" and not checks["bf16"]["native_16bit_psum"]
    table = (tmp_path / "bench_kernels.md").read_text()
    assert "| terngrad compress |" in table and "| bf16 |" in table
