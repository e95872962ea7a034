"""Latency model: step-time physics, shipped profiles, loading errors, the CLI, and the kernel fit."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from burstgym import latency
from burstgym.latency import (
    LatencyModel,
    compose_latency_model,
    list_profiles,
    load_model_config,
    load_profile,
    provisional_h100_llama2_7b,
    step_time,
)

REQUIRED = [
    "h100-llama-2-7b-tp1",
    "h100-llama-3-8b-tp1",
    "a100-llama-2-7b-tp1",
    "a100-llama-3-8b-tp1",
    "h100-llama-2-70b-tp8",
    "a100-llama-2-70b-tp8",
    "h200-llama-3-8b-tp1",
]


def shared_calibration() -> Path:
    env = os.environ.get("BURSTGYM_SHARED_DATA")
    base = Path(env) if env else Path(__file__).resolve().parents[1].parent / "shared" / "data"
    return base / "calibration"


needs_e2e = pytest.mark.skipif(
    not (shared_calibration() / "splitwise").is_dir(),
    reason="end-to-end calibration data absent (../shared/data/calibration or $BURSTGYM_SHARED_DATA)",
)


needs_data = pytest.mark.skipif(
    not (shared_calibration() / "vidur").is_dir(),
    reason="calibration data absent (../shared/data/calibration or $BURSTGYM_SHARED_DATA)",
)


def test_required_profiles_ship_and_load() -> None:
    assert set(REQUIRED) <= set(list_profiles())
    for name in list_profiles():
        p = load_profile(name)
        assert p.name == name
        assert isinstance(p.latency, LatencyModel)
        assert p.kv_capacity_tokens > 10_000
        assert p.busy_power_w > p.idle_power_w > 0
        for key in ("kind", "source_files", "fit_date", "fit_error", "engine", "power"):
            assert key in p.provenance
        # The stored coefficients are the composition of the stored GPU constants, architecture and
        # engine terms; the GPU constants carry no serving overhead of their own.
        assert p.gpu.overhead_s == 0 and p.gpu.overhead_seq_s == 0
        np.testing.assert_allclose(
            p.latency, compose_latency_model(p.gpu, p.model, p.tp, p.engine_terms), rtol=1e-9
        )


def test_kv_bytes_and_power_per_node() -> None:
    assert load_profile("h100-llama-3-8b-tp1").kv_bytes_per_token == 128 * 1024
    assert load_profile("h100-llama-2-7b-tp1").kv_bytes_per_token == 512 * 1024
    tp8 = load_profile("h100-llama-2-70b-tp8")
    assert tp8.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2
    assert tp8.busy_power_w == 8 * 700.0
    # KV capacity: 0.9 x 80 GB minus 16 GB of weights and activations, over 128 KiB a token.
    assert 420_000 < load_profile("h100-llama-3-8b-tp1").kv_capacity_tokens < 500_000


def test_h200_is_derived_faster_and_larger_than_h100() -> None:
    h100, h200 = load_profile("h100-llama-3-8b-tp1"), load_profile("h200-llama-3-8b-tp1")
    assert h200.provenance["kind"] == "derived" and h100.provenance["kind"] == "measured"
    assert h200.kv_capacity_tokens > 1.8 * h100.kv_capacity_tokens
    assert float(h200.step_time(decode_seqs=32, kv_tokens=32 * 1024)) < float(
        h100.step_time(decode_seqs=32, kv_tokens=32 * 1024)
    )


def test_empty_batch_is_free_and_arrays_broadcast() -> None:
    m = load_profile("h100-llama-3-8b-tp1")
    assert float(m.step_time(prefill_tokens=0, decode_seqs=0, kv_tokens=0)) == 0.0
    out = m.step_time(
        prefill_tokens=jnp.array([[0], [128]]), decode_seqs=jnp.array([0, 1, 32]), kv_tokens=4096
    )
    assert out.shape == (2, 3)
    assert float(out[0, 0]) == 0.0 and bool(jnp.all(out.ravel()[1:] > 0))


def test_step_time_jits_and_vmaps_over_stacked_profiles() -> None:
    models = [load_profile(n).latency for n in ("h100-llama-3-8b-tp1", "a100-llama-3-8b-tp1")]
    stacked = jax.tree.map(lambda *xs: jnp.asarray(xs), *models)
    f = jax.jit(jax.vmap(step_time, in_axes=(0, None, None, None)))
    out = f(stacked, 0.0, 16.0, 16.0 * 1024)
    assert out.shape == (2,) and float(out[0]) < float(out[1])  # H100 faster than A100
    grad = jax.grad(lambda k: step_time(models[0], 0.0, 16.0, k))(1024.0)
    assert float(grad) > 0


def test_decode_is_memory_bound_below_the_knee() -> None:
    """An extra decode sequence costs far less than the fixed part of the pass (the premise of skew)."""
    m = load_profile("h100-llama-3-8b-tp1")
    t1 = float(m.step_time(decode_seqs=1, kv_tokens=512))
    t32 = float(m.step_time(decode_seqs=32, kv_tokens=32 * 512))
    assert t32 < 1.5 * t1  # 32x the work for well under 2x the time
    t2048 = float(m.step_time(prefill_tokens=2048))
    t4096 = float(m.step_time(prefill_tokens=4096))
    assert 1.9 < t4096 / t2048 < 3.0  # compute-bound linear plus quadratic attention


def test_step_time_matches_vidur_kernel_sums_plus_overhead() -> None:
    """Linear-layer time at 1 and 4096 tokens against SOURCES.md's hand-read Vidur sums."""
    m = load_profile("h100-llama-2-7b-tp1").latency
    zero = m._replace(
        overhead_s=0.0,
        overhead_seq_s=0.0,
        logits_seq_s=0.0,
        attn_fixed_s=0.0,
        attn_seq_s=0.0,
        kv_token_s=0.0,
        prefill_fixed_s=0.0,
        prefill_pair_s=0.0,
    )
    lm_head = 32000 * 4096 * 2 / load_profile("h100-llama-2-7b-tp1").gpu.mem_bw
    assert abs(float(step_time(zero, 4096, 0, 0)) - 83.3e-3) / 83.3e-3 < 0.1
    assert abs(float(step_time(zero, 1, 0, 0)) - lm_head - 5.60e-3) / 5.60e-3 < 0.1


def test_provisional_is_the_h100_llama2_7b_profile() -> None:
    assert provisional_h100_llama2_7b() == load_profile("h100-llama-2-7b-tp1").latency


def test_unknown_profile_lists_known() -> None:
    with pytest.raises(ValueError, match="h100-llama-3-8b-tp1"):
        load_profile("h100-gpt-5")


def test_malformed_profiles_name_file_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        load_profile(bad)
    data = load_profile("h100-llama-3-8b-tp1").to_dict()
    del data["latency"]["kv_token_s"]
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="bad.json.*kv_token_s"):
        load_profile(bad)
    data = load_profile("h100-llama-3-8b-tp1").to_dict()
    data["kv_capacity_tokens"] = "lots"
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="kv_capacity_tokens"):
        load_profile(bad)


def test_profile_round_trips_through_a_path(tmp_path: Path) -> None:
    p = load_profile("a100-llama-2-70b-tp8")
    path = tmp_path / "copy.json"
    path.write_text(json.dumps(p.to_dict()))
    q = load_profile(str(path))
    assert q.latency == p.latency and q.kv_capacity_tokens == p.kv_capacity_tokens


def test_model_configs_and_hf_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="llama-3-8b"):
        load_model_config("gpt-9")
    assert load_model_config("llama-3-8b").kv_bytes_per_token() == 128 * 1024
    hf = {
        "model_type": "mistral",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 32000,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    }
    cfg = tmp_path / "mistral" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text(json.dumps(hf))
    m = load_model_config(cfg)
    assert m.name == "mistral" and m.gated_mlp and m.head_dim == 128
    assert 6.9e9 < m.num_layers * m.layer_params() + 2 * m.lm_head_params() < 7.4e9  # Mistral-7B: 7.24B
    cfg.write_text(json.dumps({**hf, "hidden_size": "big"}))
    with pytest.raises(ValueError, match="config.json.*hidden_size"):
        load_model_config(cfg)


def test_cli_show(capsys: pytest.CaptureFixture[str]) -> None:
    latency.main(["show", "h100-llama-3-8b-tp1", "--batches", "1", "64", "--contexts", "1024"])
    out = capsys.readouterr().out
    assert "KV capacity" in out and "decode step time" in out and "engine vllm-ci" in out
    assert "node power" in out
    latency.main(["show", "h100-llama-2-70b-tp8", "--engine", "splitwise-2023", "--batches", "1"])
    assert "engine splitwise-2023" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        latency.main(["show", "h100-llama-3-8b-tp1", "--engine", "nope"])
    assert "unknown engine" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--batches", "-1", "0"], "--batches"),
        (["--batches", "0"], "--batches"),
        (["--contexts", "0"], "--contexts"),
        (["--contexts", "x"], "--contexts"),
    ],
)
def test_cli_show_refuses_bad_flags_in_one_line(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        latency.main(["show", "h100-llama-3-8b-tp1", *flags])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and f"argument {named}:" in captured.err


def test_cli_list_and_engines(capsys: pytest.CaptureFixture[str]) -> None:
    latency.main(["list"])
    assert "h100-llama-3-8b-tp1" in capsys.readouterr().out.split()
    latency.main(["engines"])
    out = capsys.readouterr().out
    assert "vllm-ci (default)" in out and "splitwise-2023" in out and "kernels" in out


def test_python_dash_m_entry_points_run() -> None:
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    for args in (["-m", "burstgym.latency", "list"], ["-m", "burstgym.calibrate", "--help"]):
        run = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=repo, check=False)
        assert run.returncode == 0, run.stderr


@needs_e2e
def test_cli_validate_prints_the_heldout_table(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        latency.main(["validate"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "| A100 | TP2 | TP4 |" in out and "vllm-ci" in out and "A100 energy" in out


@needs_data
def test_fit_quality_on_held_out_points() -> None:
    """The issue's acceptance: linear layers within 5% MAPE per GPU, attention within 15%."""
    from burstgym.latency.fit import concat_samples, fit_attention_heldout, fit_linear_heldout
    from burstgym.latency.sources import read_vidur_attention, read_vidur_linear

    root = shared_calibration()
    for gpu in ("a100", "h100"):
        samples, _ = read_vidur_linear(root, gpu)
        _, report = fit_linear_heldout(concat_samples(list(samples.values())))
        assert report["heldout_mape"] < 0.05, (gpu, report)
    _, report = fit_attention_heldout(read_vidur_attention(root))
    assert report["heldout_mape"] < 0.15, report


def test_any_tp_of_a_known_model_and_gpu_composes() -> None:
    """`h100-llama-2-70b-tp4` is not shipped but resolves; a shipped profile equals its composition."""
    from burstgym.latency import compose_profile, list_gpus

    assert "h100-llama-2-70b-tp4" not in list_profiles()
    assert {"a100", "h100", "h200", "l40s"} <= set(list_gpus())
    p = load_profile("h100-llama-2-70b-tp4")
    assert p.name == "h100-llama-2-70b-tp4" and p.tp == 4 and p.engine == "vllm-ci"
    assert p.provenance["kind"] == "measured" and "composed" in p.provenance["detail"]
    tp8 = load_profile("h100-llama-2-70b-tp8")
    assert float(p.latency.weights_s) == pytest.approx(2 * float(tp8.latency.weights_s), rel=1e-6)
    shipped, composed = load_profile("h100-codellama-34b-tp2"), compose_profile("h100", "codellama-34b", 2)
    for a, b in zip(shipped.latency, composed.latency, strict=True):
        assert float(b) == pytest.approx(float(a), rel=1e-6)
    assert composed.kv_capacity_tokens == shipped.kv_capacity_tokens
    assert load_profile("h100-llama-2-70b-tp4", engine="splitwise-2023").engine == "splitwise-2023"
    for bad, message in (
        ("h100-llama-2-70b-tp3", "do not shard over TP=3"),
        ("l40s-llama-2-70b-tp1", "does not fit"),
        ("h900-llama-2-70b-tp4", "GPUs: a100, h100, h200, l40s"),
        ("h100-gpt-9-tp1", "unknown profile"),
    ):
        with pytest.raises(ValueError, match=message):
            load_profile(bad)
    with pytest.raises(ValueError, match="profile must be a name or a path"):
        load_profile(123)  # type: ignore[arg-type]


def test_l40s_is_derived_from_its_datasheet() -> None:
    """L40S: slower memory than the A100 (864 vs 2039 GB/s), 48 GB, 350 W, PCIe all-reduce."""
    from burstgym.latency import load_gpu

    l40s, a100 = load_gpu("l40s"), load_gpu("a100")
    assert l40s.provenance["kind"] == "derived" and "datasheet" in l40s.provenance["detail"]
    assert l40s.gpu.mem_bw == pytest.approx(a100.gpu.mem_bw * 864 / 2039, rel=1e-9)
    assert l40s.busy_w == 350.0 and 47e9 < l40s.gpu.memory_bytes < 49e9
    assert l40s.gpu.allreduce["2"][1] < a100.gpu.allreduce["2"][1] / 5  # PCIe, not NVLink
    on_l40s, on_a100 = load_profile("l40s-llama-3-8b-tp1"), load_profile("a100-llama-3-8b-tp1")
    assert float(on_l40s.step_time(decode_seqs=1, kv_tokens=512)) > float(
        on_a100.step_time(decode_seqs=1, kv_tokens=512)
    )
    assert on_l40s.kv_capacity_tokens < on_a100.kv_capacity_tokens


def test_profile_from_a_hugging_face_config(tmp_path: Path) -> None:
    """A dense config.json of any size and TP, and a MoE one, compose by path; nothing is fetched."""
    qwen = {
        "architectures": ["Qwen3ForCausalLM"],
        "num_hidden_layers": 64,
        "hidden_size": 5120,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 25600,
        "vocab_size": 151936,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    cfg = tmp_path / "Qwen3-32B" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text(json.dumps(qwen))
    p = load_profile(f"h100-tp4:{cfg}")
    assert p.model.name == "Qwen3-32B" and p.tp == 4
    params = p.model.num_layers * p.model.layer_params() + 2 * p.model.lm_head_params()
    assert 32.0e9 < params < 33.5e9  # Qwen3-32B: 32.8B
    moe = {**qwen, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768}
    moe |= {"num_hidden_layers": 48, "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4}
    cfg.write_text(json.dumps(moe))
    m = load_profile(f"h200-tp2:{cfg}")
    assert m.model.num_experts == 128 and float(m.latency.expert_fraction) == pytest.approx(8 / 128)
    total = m.model.num_layers * m.model.stored_layer_params() + 2 * m.model.lm_head_params()
    active = m.model.num_layers * m.model.layer_params() + m.model.lm_head_params()
    assert 29.5e9 < total < 31.5e9 and 2.9e9 < active < 3.5e9  # Qwen3-30B-A3B: 30.5B, 3.3B active
    for key, value, message in (
        ("kv_lora_rank", 512, "multi-head latent attention"),
        ("quantization_config", {"quant_method": "fp8"}, "quantized weights"),
        ("num_experts_per_tok", 300, "num_experts_per_tok"),
    ):
        cfg.write_text(json.dumps({**moe, key: value}))
        with pytest.raises(ValueError, match=message):
            load_profile(f"h100-tp2:{cfg}")


def test_cli_gpus_and_models(capsys: pytest.CaptureFixture[str]) -> None:
    latency.main(["gpus"])
    out = capsys.readouterr().out
    assert "l40s: L40S-48GB (derived)" in out and "h100: H100-SXM5-80GB (measured)" in out
    latency.main(["models"])
    assert "mixtral-8x7b" in capsys.readouterr().out.split()
