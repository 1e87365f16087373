"""Hugging Face parity: tiny random transformers models -> load_hf -> same logits; save_hf -> transformers loads it."""
import functools, json, os
from pathlib import Path

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from flax import nnx

import torch, transformers  # dev extra

from safetensors.numpy import save_file
from maxpost.checkpoint import (load_hf, save_hf, hf_config_to_model_config, model_config_to_hf_config,
                                hf_param_map, hf_state_dict)
from maxpost.model import init_cache
from maxpost.sharding import make_mesh

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              vocab_size=128, intermediate_size=96, max_position_embeddings=256,
              initializer_range=0.25)   # large enough that attention (and each layout convention) moves the logits


def _llama():
    return transformers.LlamaConfig(**COMMON, rope_parameters=dict(
        rope_type="llama3", rope_theta=10_000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16), rms_norm_eps=1e-5, tie_word_embeddings=False)


def _qwen3():
    return transformers.Qwen3Config(**COMMON, rope_parameters=dict(rope_type="default", rope_theta=1e6),
                                    tie_word_embeddings=True)


def _gemma3():
    # window 4 < sequence length 24; 7 layers: 5 local, 1 global (layer 5), 1 local
    return transformers.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 7}, sliding_window=4,
                                         query_pre_attn_scalar=24, rope_parameters={
                                             "full_attention": dict(rope_type="linear", factor=4.0, rope_theta=1e6),
                                             "sliding_attention": dict(rope_type="default", rope_theta=1e4)})


CONFIGS = {"llama": (_llama, transformers.LlamaForCausalLM), "qwen3": (_qwen3, transformers.Qwen3ForCausalLM),
           "gemma3": (_gemma3, transformers.Gemma3ForCausalLM)}


def _hf_model(family, seed=0):
    make_cfg, cls = CONFIGS[family]
    torch.manual_seed(seed)
    model = cls(make_cfg()).eval().float()
    # random norm weights so that norms (and Gemma's 1+w) are really exercised
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name: p.normal_(0.0, 0.3)
    return model


def _hf_logits(model, tokens, attention_mask=None, position_ids=None):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(np.asarray(tokens)), attention_mask=attention_mask,
                    position_ids=position_ids)
    return out.logits.float().numpy()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def saved(request, tmp_path_factory):
    family = request.param
    path = tmp_path_factory.mktemp(family)
    hf = _hf_model(family)
    hf.config._attn_implementation = "eager"
    hf.save_pretrained(path, safe_serialization=True)
    return family, path, hf


def _tokens(seed=0, shape=(2, 24), vocab=128):
    return np.random.default_rng(seed).integers(0, vocab, shape)


def test_logits_match_transformers(saved):
    """load_hf of a tiny random HF model gives transformers' logits within 1e-4 (fp32)."""
    family, path, hf = saved
    model = load_hf(path)
    tokens = _tokens()
    diff = np.abs(np.asarray(model(jnp.asarray(tokens))) - _hf_logits(hf, tokens)).max()
    print(f"{family}: max |logits - transformers| = {diff:.2e}")
    assert diff < 1e-4


def test_config_mapping(saved):
    """The maxpost config reflects the HF switches (rope scaling, windows, layer pattern)."""
    family, path, _ = saved
    cfg = hf_config_to_model_config(json.loads((path / "config.json").read_text()))
    assert cfg.family == family
    if family == "llama":
        assert (cfg.rope_type, cfg.rope_factor, cfg.rope_original_max_len, cfg.tie_embeddings) == ("llama3", 8.0, 16, False)
    if family == "gemma3":
        assert [cfg.is_local(i) for i in range(7)] == [True] * 5 + [False, True]
        assert (cfg.sliding_window, cfg.rope_type, cfg.rope_factor, cfg.local_rope_theta) == (4, "linear", 4.0, 1e4)
        assert cfg.query_pre_attn_scalar == 24
    assert hf_config_to_model_config(model_config_to_hf_config(cfg)) == cfg


def test_save_hf_roundtrip(saved, tmp_path):
    """save_hf writes a directory that transformers loads and that gives the same logits."""
    family, path, hf = saved
    model = load_hf(path)
    save_hf(model, tmp_path / "export")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", attn_implementation="eager").eval()
    assert type(back) is type(hf)
    tokens = _tokens(1)
    diff = np.abs(_hf_logits(back, tokens) - _hf_logits(hf, tokens)).max()
    assert diff < 1e-5
    assert np.abs(np.asarray(model(jnp.asarray(tokens))) - _hf_logits(back, tokens)).max() < 1e-4


def test_left_padded_matches_transformers(saved):
    """A left-padded batch (pads = segment 0, positions from 0 at the first real token) matches transformers with
    an attention mask and the same position ids."""
    family, path, hf = saved
    model = load_hf(path)
    tokens = _tokens(2, (2, 16))
    seg = np.ones((2, 16), np.int32); seg[0, :5] = 0
    pos = np.maximum(np.cumsum(seg, 1) - 1, 0)
    ours = np.asarray(model(jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(seg)))
    theirs = _hf_logits(hf, tokens, torch.tensor(seg), torch.tensor(pos))
    assert np.abs(ours[0, 5:] - theirs[0, 5:]).max() < 1e-4
    assert np.abs(ours[1] - theirs[1]).max() < 1e-4


def test_sharded_load_matches(saved):
    """Loading onto a 2x2x2 mesh places weights in shards and gives the same logits (jitted, mesh active)."""
    family, path, _ = saved
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    model, sharded = load_hf(path), load_hf(path, mesh=mesh)
    q = sharded.layers.attn.q_proj[...]                                           # the stack: layers unsharded
    assert q.sharding.spec == jax.P(None, "fsdp", "tensor", None) and len(q.addressable_shards) == 8
    tokens = jnp.asarray(_tokens(3, (4, 16)))
    with jax.set_mesh(mesh):
        got = nnx.jit(lambda m, t: m(t))(sharded, tokens)
    assert np.abs(np.asarray(got) - np.asarray(model(tokens))).max() < 1e-4


def test_bf16_load_close(saved):
    """dtype=bfloat16 loads bf16 params, computes in bf16, returns fp32 logits loosely close to fp32."""
    family, path, hf = saved
    model = load_hf(path, dtype=jnp.bfloat16)
    assert model.layers[0].mlp.up_proj[...].dtype == jnp.bfloat16
    tokens = _tokens(4)
    logits = np.asarray(model(jnp.asarray(tokens)))
    assert logits.dtype == np.float32
    ref = _hf_logits(hf, tokens)
    assert np.abs(logits - ref).max() < 0.1 * np.abs(ref).max() + 0.05


def test_sharded_index_checkpoint(saved, tmp_path):
    """A checkpoint split over several files with model.safetensors.index.json loads the same."""
    family, path, _ = saved
    model = load_hf(path)
    tensors = hf_state_dict(model)
    names = sorted(tensors)
    out = tmp_path / "split"; out.mkdir()
    (out / "config.json").write_text((path / "config.json").read_text())
    weight_map = {}
    for i, chunk in enumerate([names[: len(names) // 2], names[len(names) // 2:]]):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: tensors[k] for k in chunk}, str(out / fname), metadata={"format": "pt"})
        weight_map |= {k: fname for k in chunk}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    tokens = jnp.asarray(_tokens(5))
    assert np.abs(np.asarray(load_hf(out)(tokens)) - np.asarray(model(tokens))).max() == 0


def test_gemma3_conditional_generation_text_weights(tmp_path):
    """Text weights of a Gemma3ForConditionalGeneration checkpoint (model.language_model.* names) load."""
    text = _gemma3()
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4)
    torch.manual_seed(0)
    mm = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    mm.save_pretrained(tmp_path, safe_serialization=True)
    model = load_hf(tmp_path)
    tokens = _tokens(6, (1, 12))
    with torch.no_grad():
        ref = mm.model.language_model(input_ids=torch.tensor(tokens)).last_hidden_state
        ref = mm.lm_head(ref).float().numpy()
    assert np.abs(np.asarray(model(jnp.asarray(tokens))) - ref).max() < 1e-4


def _write(path, config, tensors):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_errors(saved, tmp_path):
    """Shape mismatches, missing tensors, unsupported architectures and features fail naming the culprit."""
    family, path, _ = saved
    config = json.loads((path / "config.json").read_text())
    tensors = hf_state_dict(load_hf(path))
    name = "model.layers.1.self_attn.k_proj.weight"
    bad = dict(tensors); bad[name] = np.zeros((8, 64), np.float32)
    _write(tmp_path / "shape", config, bad)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_hf(tmp_path / "shape")
    missing = {k: v for k, v in tensors.items() if k != name}
    _write(tmp_path / "missing", config, missing)
    with pytest.raises(KeyError, match=name.replace(".", r"\.")):
        load_hf(tmp_path / "missing")
    _write(tmp_path / "arch", {**config, "architectures": ["MistralForCausalLM"]}, tensors)
    with pytest.raises(ValueError, match="unsupported architecture"):
        load_hf(tmp_path / "arch")
    extra = dict(tensors); extra["model.layers.0.self_attn.q_proj.bias"] = np.zeros(64, np.float32)
    _write(tmp_path / "extra", config, extra)
    with pytest.raises(ValueError, match="q_proj.bias"):
        load_hf(tmp_path / "extra")
    with pytest.raises(ValueError, match="attention_bias"):
        hf_config_to_model_config({**config, "attention_bias": True})


def test_param_map_covers_model(saved):
    """hf_param_map names every parameter exactly once and every HF tensor of the checkpoint."""
    family, path, hf = saved
    model = load_hf(path)
    paths = [e.path for e in hf_param_map(model.cfg)]
    from maxpost.model import layer_paths
    assert sorted(map(str, paths)) == sorted(map(str, layer_paths(model)))          # a stacked weight: a path per layer
    hf_names = {k for k in hf.state_dict() if "rotary" not in k}
    if model.cfg.tie_embeddings: hf_names.discard("lm_head.weight")
    assert {e.hf_name for e in hf_param_map(model.cfg)} == hf_names


def test_run_config_reaches_a_hugging_face_model(saved, tmp_path):
    """`dtype` (compute), `param_dtype` and `remat_policy` of a run apply to a model loaded from a Hugging Face
    directory: float32 weights computing in bfloat16 give logits other than float32 compute, close to them."""
    from maxpost.config import load_config
    from maxpost.policy import load_policy
    family, path, hf = saved
    cfg = load_config("sft", [f"base_output_directory={tmp_path}", "run_name=x", f"load_parameters_path={path}",
                              "dtype=bfloat16", "param_dtype=float32", "remat_policy=full"])
    model = load_policy(cfg, None)
    assert (model.cfg.dtype, model.cfg.param_dtype, model.cfg.remat) == ("bfloat16", "float32", "full")
    assert model.layers[0].mlp.up_proj[...].dtype == jnp.float32
    tokens = jnp.asarray(_tokens(5))
    mixed, full = np.asarray(model(tokens)), np.asarray(load_hf(path)(tokens))
    assert 0 < np.abs(mixed - full).max() < 0.1 * np.abs(full).max() + 0.05


# ---- reliability of checkpoints (issue 21: items 8, 11, 13, 16) ----
import subprocess, sys, textwrap, warnings
from pathlib import Path

from maxpost.checkpoint import checkpoint_manager, save_state, restore_state, CheckpointError
from maxpost.convert import convert_main, hf_to_maxpost
from maxpost.model import get_model_config, create_model

ROOT = Path(__file__).resolve().parent.parent


def _tiny_state(seed):
    m = create_model(get_model_config("tiny", num_layers=1, d_model=64, mlp_dim=128, vocab_size=64), seed=seed)
    return nnx.state(m, nnx.Param)


def _equal_trees(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def test_failed_checkpoint_write_exits_with_a_message(tmp_path):
    """A write that fails (here: the step directory cannot be created, as in an unwritable run directory) raises at
    once with a message naming the step and directory, the process exits non-zero instead of hanging at shutdown on
    Orbax's threads, and the previous checkpoint still restores."""
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(ROOT)!r})
        import jax.numpy as jnp
        from maxpost.checkpoint import checkpoint_manager, save_state
        d = {str(tmp_path / "ckpts")!r}
        mgr = checkpoint_manager(d, max_to_keep=2)
        save_state(mgr, 1, {{"w": jnp.ones((4, 4))}}, meta={{"data": 1}})
        real_mkdir = os.mkdir
        def refuse(p, *a, **k):   # what a read-only directory does to every new entry
            if str(p).startswith(d): raise PermissionError(13, "Permission denied", str(p))
            return real_mkdir(p, *a, **k)
        os.mkdir = refuse
        save_state(mgr, 2, {{"w": jnp.zeros((4, 4))}}, meta={{"data": 2}})
        print("the failed save returned")
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"})
    assert r.returncode != 0 and "the failed save returned" not in r.stdout
    assert "step 2" in r.stderr and "Permission denied" in r.stderr, r.stderr[-2000:]
    p, _, meta = restore_state(checkpoint_manager(tmp_path / "ckpts"), {"w": jnp.zeros((4, 4))})
    assert meta["step"] == 1 and np.array_equal(np.asarray(p["w"]), np.ones((4, 4)))


def _corrupt(step_dir):
    "Delete one array data file of a step (OCDBT keeps the arrays in d/ files)."
    files = sorted(f for f in (step_dir / "params").rglob("*") if f.is_file() and f.parent.name == "d")
    assert files, list((step_dir / "params").rglob("*"))
    for f in files: f.unlink()


def test_corrupted_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    """restore_state (newest by default) warns about a step that does not restore and returns the newest one that
    does; meta['step'] says which. With every step corrupted it raises CheckpointError naming each failure."""
    s1, s2 = _tiny_state(1), _tiny_state(2)
    mgr = checkpoint_manager(tmp_path / "c")
    save_state(mgr, 2, s1, meta={"data": "a"})
    save_state(mgr, 4, s2, meta={"data": "b"})
    _corrupt(tmp_path / "c" / "4")
    with pytest.warns(UserWarning, match="step 4"):
        p, _, meta = restore_state(checkpoint_manager(tmp_path / "c"), _tiny_state(0))
    assert meta == {"data": "a", "step": 2} and _equal_trees(p, s1)
    _corrupt(tmp_path / "c" / "2")
    from maxpost.checkpoint import CheckpointError
    with pytest.warns(UserWarning), pytest.raises(CheckpointError, match="step 4.*step 2"):
        restore_state(checkpoint_manager(tmp_path / "c"), _tiny_state(0))


def test_saving_again_after_a_fallback_sets_the_bad_step_aside(tmp_path):
    """After resuming from step 2 because step 4 is corrupted, the run saves step 4 again: the save happens (Orbax
    alone would skip a step that is not newer than the latest, or refuse an existing one), the bad step is kept as
    4.set-aside, and the new step 4 is the newest and restores."""
    s1, s2, s3 = _tiny_state(1), _tiny_state(2), _tiny_state(3)
    mgr = checkpoint_manager(tmp_path / "c", max_to_keep=2)
    save_state(mgr, 2, s1, meta={"data": "a"})
    save_state(mgr, 4, s2, meta={"data": "b"})
    _corrupt(tmp_path / "c" / "4")
    mgr = checkpoint_manager(tmp_path / "c", max_to_keep=2)     # the rerun
    with pytest.warns(UserWarning, match="step 4"):
        _, _, meta = restore_state(mgr, _tiny_state(0))
    assert meta["step"] == 2
    with pytest.warns(UserWarning, match="set-aside"):
        save_state(mgr, 4, s3, meta={"data": "c"})
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["2", "4", "4.set-aside"]
    p, _, meta = restore_state(checkpoint_manager(tmp_path / "c"), _tiny_state(0))
    assert meta == {"data": "c", "step": 4} and _equal_trees(p, s3)


def test_extra_checkpoints_are_pruned_when_the_run_starts(tmp_path):
    """Steps above max_to_keep (a kill between a save and Orbax's cleanup leaves them) are deleted when the run's
    manager opens, oldest first; without max_to_keep nothing is deleted."""
    d = tmp_path / "c"
    mgr = checkpoint_manager(d)
    for s in range(1, 6): save_state(mgr, s, {"w": jnp.full((2,), float(s))})
    checkpoint_manager(d)
    assert sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) == [1, 2, 3, 4, 5]
    checkpoint_manager(d, max_to_keep=2)
    assert sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) == [4, 5]


def test_truncated_safetensors_names_the_file(tmp_path):
    """A truncated weights file fails with an error that names the file."""
    from maxpost.checkpoint import save_hf
    path = save_hf(create_model(get_model_config("tiny", num_layers=1)), tmp_path / "whole")
    out = tmp_path / "cut"; out.mkdir()
    (out / "config.json").write_text((path / "config.json").read_text())
    data = (path / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(ValueError, match=str(out / "model.safetensors")):
        load_hf(out)


def test_convert_refuses_a_non_empty_destination_unless_overwrite(tmp_path, capsys):
    """`maxpost convert HF DST` into an existing run refuses (exit 2, DST untouched); with --overwrite DST is
    replaced whole: only the new checkpoint, no stray files, the new weights."""
    from maxpost.checkpoint import save_hf
    for seed in (1, 2):
        save_hf(create_model(get_model_config("tiny", num_layers=1), seed=seed), tmp_path / f"hf{seed}")
    dst = tmp_path / "run"
    assert convert_main([str(tmp_path / "hf1"), str(dst)]) == 0
    save_state(checkpoint_manager(dst / "checkpoints"), 7, _tiny_state(3))     # a later step of that run
    (dst / "notes.txt").write_text("mine")
    before = sorted(str(p.relative_to(dst)) for p in dst.rglob("*"))
    assert convert_main([str(tmp_path / "hf2"), str(dst)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert sorted(str(p.relative_to(dst)) for p in dst.rglob("*")) == before
    assert convert_main([str(tmp_path / "hf2"), str(dst), "--overwrite"]) == 0
    assert not (dst / "notes.txt").exists()
    assert sorted(int(p.name) for p in (dst / "checkpoints").iterdir() if p.name.isdigit()) == [0]
    model = load_hf(tmp_path / "hf2")
    p, _, _ = restore_state(checkpoint_manager(dst / "checkpoints"), nnx.state(model, nnx.Param))
    assert _equal_trees(p, nnx.state(model, nnx.Param))


def _rss_gib() -> float:
    with open("/proc/self/statm") as f: return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def test_a_save_holds_about_its_limit_in_flight_not_a_copy_of_the_state(tmp_path):
    """Orbax's default writes every array at once: on a CPU host the save held a second copy of the whole state
    (+2.8 GiB for this 3 GiB tree, measured). With `save_limit_gb` (1 GB here: every array is 256 MiB) at most
    1 GB (0.93 GiB) is in flight, so the peak must stay well under the state's size."""
    import threading, time
    from maxpost.checkpoint import checkpoint_manager, restore_state, save_limit_gb, save_state
    n = 64 * 2**20   # 256 MiB of float32 per array, 12 arrays; a hash of the index, so that nothing compresses it away
    bits = lambda i: (jnp.arange(n, dtype=jnp.uint32) + i * n) * jnp.uint32(2654435761) >> 9 | 0x3F800000
    mix = jax.jit(lambda i: jax.lax.bitcast_convert_type(bits(i), jnp.float32))   # floats in [1, 2)
    tree = {f"w{i}": mix(jnp.uint32(i)) for i in range(12)}
    jax.block_until_ready(tree)
    assert save_limit_gb(tree) == 1
    base, peak, done = _rss_gib(), [0.0], threading.Event()
    def sample():
        while not done.is_set(): peak[0] = max(peak[0], _rss_gib()); time.sleep(0.01)
    th = threading.Thread(target=sample); th.start()
    try: save_state(checkpoint_manager(tmp_path / "c", save_concurrent_gb=save_limit_gb(tree)), 1, tree)
    finally: done.set(); th.join()
    assert peak[0] - base < 1.5, f"the save took {peak[0] - base:.2f} GiB more than the 3 GiB state it wrote"
    like = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in tree.items()}
    back, _, _ = restore_state(checkpoint_manager(tmp_path / "c"), like)
    for k in ("w0", "w11"): np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(tree[k]))
    import shutil; shutil.rmtree(tmp_path / "c")   # 3 GiB on disk: not left for the end of the session


def test_a_symlinked_checkpoint_step_is_never_deleted_through_and_the_run_resumes(tmp_path):
    """issue 32, item 1: a step directory moved to another disk and linked back. Pruning keeps the link (and its
    target) with a warning that says what to do, instead of failing the save (exit 5) and every rerun (exit 1)."""
    import shutil
    from maxpost.config import load_config
    from maxpost.sft import train_sft
    from maxpost.rundir import read_metrics
    args = [f"base_output_directory={tmp_path}", "run_name=r", "train_split=train[:64]", "eval_split=test[:8]",
            "global_batch_size=8", "max_target_length=160", "eval_batches=1", "warmup_steps=0", "log_period=2",
            "checkpoint_period=2", "max_checkpoints_to_keep=2"]
    train_sft(load_config("sft", [*args, "steps=4"]), progress=False)
    ck, away = tmp_path / "r" / "checkpoints", tmp_path / "other-disk" / "2"
    away.parent.mkdir(); shutil.move(ck / "2", away); (ck / "2").symlink_to(away)
    r = subprocess.run([sys.executable, "-m", "maxpost.cli", "sft", *args, "steps=6"], capture_output=True, text=True,
                       timeout=900, cwd=ROOT, env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "checkpoint step 2" in r.stderr and "is a symbolic link" in r.stderr and "remove the link" in r.stderr
    assert (ck / "2").is_symlink() and (away / "params").is_dir()                 # neither the link nor its target touched
    assert sorted(p.name for p in ck.iterdir()) == ["2", "4", "6"]                # the newest 2, and the link
    out = train_sft(load_config("sft", [*args, "steps=8"]), progress=False)       # and the run still resumes
    assert out["step"] == 8 and [m["step"] for m in read_metrics(tmp_path / "r", "train")] == [2, 4, 6, 8]
    assert sorted(p.name for p in ck.iterdir()) == ["2", "6", "8"]                # a real old step is still pruned


RANDOM_STATE = """
def _random_state(seed=0):
    "The tiny model's weights and an AdamW state of random values (zeros would compress to nothing on disk)."
    import jax, jax.numpy as jnp, optax
    from flax import nnx
    from maxpost.model import create_model, get_model_config
    params = nnx.state(create_model(get_model_config("tiny"), seed=seed), nnx.Param)
    noise = lambda x: x + jax.random.normal(jax.random.key(seed + 1), x.shape, x.dtype) if x.dtype == jnp.float32 else x
    return params, jax.tree.map(noise, optax.adamw(1e-3).init(params))
"""
exec(RANDOM_STATE)   # here, and in the subprocess below


def test_a_save_the_disk_has_no_room_for_is_refused_before_writing(tmp_path, monkeypatch):
    """issue 32: a full disk is seen before Orbax writes a byte: one CheckpointError naming the step, the room it
    needs and what is intact; nothing of the refused step on disk, the earlier step restores."""
    import collections, shutil
    import maxpost.checkpoint as C
    params, opt = _random_state()
    mgr = checkpoint_manager(tmp_path / "ck", max_to_keep=2)
    save_state(mgr, 1, params, opt)
    used = sum(f.stat().st_size for f in (tmp_path / "ck" / "1").rglob("*") if f.is_file())
    need = sum(x.nbytes for x in jax.tree.leaves((params, opt)))
    assert 0.9 * need < used < 1.1 * need, (used, need)   # the estimate is what Orbax writes for trained weights
    Usage = collections.namedtuple("Usage", "total used free")
    monkeypatch.setattr(C.shutil, "disk_usage", lambda p: Usage(10**12, 10**12 - used // 2, used // 2))
    with pytest.raises(CheckpointError, match=r"checkpoint step 2 needs about 12\.\d MiB .* has 5\.\d MiB free; the "
                                              r"newest complete checkpoint \(step 1\) is intact\. Free space"):
        save_state(mgr, 2, params, opt)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["1"]
    back, _, meta = restore_state(checkpoint_manager(tmp_path / "ck"), params, opt)
    assert meta["step"] == 1


def test_a_write_that_fails_in_flight_is_one_error_not_hundreds_of_tracebacks(tmp_path):
    """issue 32: a write that fails half-way (here: a file-size limit, as a quota or a disk filled by another process
    would) used to print Orbax's traceback of every failed writer thread and ~180 "Event loop is closed" from the
    writes still in flight, burying the exit-5 message. Now stderr holds only the CheckpointError, and step 1 is intact."""
    code = RANDOM_STATE + f"""
import resource, signal, sys
from maxpost.checkpoint import checkpoint_manager, save_state, save_limit_gb, CheckpointError
params, opt = _random_state()
mgr = checkpoint_manager({str(tmp_path / "ck")!r}, max_to_keep=2, save_concurrent_gb=save_limit_gb(params, opt))
save_state(mgr, 1, params, opt)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # past the limit a write fails with EFBIG instead of killing the process
resource.setrlimit(resource.RLIMIT_FSIZE, (10**6, resource.RLIM_INFINITY))
try: save_state(mgr, 2, params, opt)
except CheckpointError as e: print("CheckpointError:", e, file=sys.stderr); sys.exit(5)
"""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 5, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("CheckpointError: could not write checkpoint step 2"), r.stderr[-3000:]
    assert "(step 1) is intact" in lines[0]
    params, opt = _random_state()
    back, _, meta = restore_state(checkpoint_manager(tmp_path / "ck"), params, opt)
    assert meta["step"] == 1
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)): np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---- a model directory that does not hold what it should (issue 43, item 4) ----
from maxpost.data import load_tokenizer
from maxpost.config import ConfigError


def test_a_config_whose_layer_count_disagrees_with_the_weights_names_both_counts(saved, tmp_path):
    "num_hidden_layers one less or one more than the weights hold: both counts and the fix, not a stray/missing tensor."
    family, path, _ = saved
    config, tensors = json.loads((path / "config.json").read_text()), hf_state_dict(load_hf(path))
    n = config["num_hidden_layers"]
    config.pop("layer_types", None)             # Gemma 3's list of layer kinds would disagree first
    for wrong in (n - 1, n + 1):
        _write(tmp_path / f"n{wrong}", {**config, "num_hidden_layers": wrong}, tensors)
        with pytest.raises(ValueError, match=rf"num_hidden_layers={wrong} but the weights hold {n} layers"):
            load_hf(tmp_path / f"n{wrong}")


def test_a_model_directory_without_tokenizer_json_is_one_line_with_the_fix(tmp_path, capsys):
    """A directory with config.json, weights and tokenizer_config.json but no tokenizer.json: load_tokenizer names the
    directory and the fix (was transformers' "You need to have sentencepiece or tiktoken installed"); a run exits 2."""
    from maxpost.cli import main
    d = tmp_path / "model"
    save_hf(create_model(get_model_config("tiny", family="llama", qk_norm=False, num_layers=1)), d)
    for cls in ("TokenizersBackend", "LlamaTokenizer"):    # transformers' error, or an empty tokenizer without a word
        (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": cls, "eos_token": "</s>"}))
        with pytest.raises(ConfigError, match=r"model has no tokenizer\.json: .*tokenizer_path=.*maxpost convert model\.gguf"):
            load_tokenizer(d)
    assert main(["eval", f"load_parameters_path={d}", f"base_output_directory={tmp_path}", "run_name=e"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{d} has no tokenizer.json" in err[0] and "sentencepiece" not in err[0], err


def test_event_loop_closed_tracebacks_stay_dropped_in_later_notebook_cells():
    """issue 43 item 7: chapter 03's committed output showed "RuntimeError: Event loop is closed" tracebacks, from a
    failed save's Tensorstore callbacks landing in a later cell: IPython sets sys.excepthook to its own at every cell,
    so the filter installed while the save ran was gone. It now filters the shell's hook too."""
    from execnb.shell import CaptureShell
    sh = CaptureShell()
    text = lambda outs: "".join("".join(o.get("text", "")) + "".join(o.get("traceback", [])) for o in outs)
    text(sh.run("from maxpost.checkpoint import _drop_closed_loop_tracebacks\n_drop_closed_loop_tracebacks()"))
    out = text(sh.run("import sys\nsys.excepthook(RuntimeError, RuntimeError('Event loop is closed'), None)\n"
                      "sys.excepthook(ValueError, ValueError('a real error'), None)\nprint('cell ran')"))
    assert "cell ran" in out and "Event loop is closed" not in out, out
    assert "a real error" in out, out      # every other exception is still shown


def test_a_run_checkpoint_loads_onto_its_shards_without_random_weights_first(tmp_path, monkeypatch):
    """issue 41: `load_policy` of a maxpost run read the checkpoint into a randomly initialised model (a program to
    compile and run, and a second copy of the weights); now into an abstract one. The weights are the saved ones bit for
    bit, on the shardings the mesh gives a fresh model; nothing random is made (create_model is not called)."""
    from maxpost.config import load_config
    from maxpost import policy, sharding, model as mm
    mcfg = get_model_config("tiny", num_layers=2, d_model=64, mlp_dim=128, vocab_size=96)
    saved = create_model(mcfg, seed=3)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "model_config.json").write_text(json.dumps(__import__("dataclasses").asdict(mcfg)))
    save_state(checkpoint_manager(run / "checkpoints"), 7, nnx.state(saved, nnx.Param))
    mesh = sharding.make_mesh(data=2, fsdp=4)
    fresh = mm.create_model(mcfg, seed=0, mesh=mesh)                 # where a fresh model's weights live on this mesh
    monkeypatch.setattr(mm, "create_model", lambda *a, **k: pytest.fail("random weights made before the restore"))
    cfg = load_config("rl", [f"base_output_directory={tmp_path}", "run_name=r", f"load_parameters_path={run}"])
    got = policy.load_policy(cfg, mesh)
    flat = lambda m: dict(nnx.to_flat_state(nnx.state(m, nnx.Param)))
    want, placed, have = flat(saved), flat(fresh), flat(got)
    assert want.keys() == have.keys() and len(have) > 10
    for k in want:
        np.testing.assert_array_equal(np.asarray(have[k][...]), np.asarray(want[k][...]), err_msg=str(k))
        assert have[k][...].sharding == placed[k][...].sharding, k
    tokens = jnp.asarray(_tokens(5, vocab=96))
    np.testing.assert_allclose(np.asarray(got(tokens)), np.asarray(saved(tokens)), rtol=1e-5, atol=1e-5)   # sharded sums


OLD_LAYOUT = Path(__file__).resolve().parent / "fixtures" / "old_layout_run"
OLD_ARGS = ["run_name=old_layout", "model_name=tiny", "train_split=train[:64]", "eval_split=test[:8]", "global_batch_size=4",
            "max_target_length=96", "log_period=1", "eval_batches=1", "warmup_steps=1",
            "model_overrides={num_layers: 2, d_model: 32, mlp_dim: 64, num_heads: 2, num_kv_heads: 1, head_dim: 16}"]


def test_a_run_of_the_per_layer_layout_loads_and_resumes(tmp_path):
    """issue 47, item 2: a run directory written before the layers were stacked (2 steps of `maxpost sft` at fa7f533,
    one array per layer: tests/fixtures/old_layout_run) restores with layer i's arrays, weights and AdamW moments, in
    slice i of the stacks, and the run resumes from its step 2, writing its next checkpoint stacked."""
    import shutil
    import orbax.checkpoint as ocp
    from maxpost.checkpoint import checkpoint_manager, restore_state, _per_layer_step
    from maxpost.config import load_config
    from maxpost.model import Decoder, ModelConfig
    from maxpost.rundir import read_metrics
    from maxpost.train import make_optimizer
    run = tmp_path / "old_layout"
    shutil.copytree(OLD_LAYOUT, run)
    record = run / "config.yml"                                                     # committed as "base_output_directory: ."
    record.write_text(record.read_text().replace("base_output_directory: .\n", f"base_output_directory: {tmp_path}\n"))
    with ocp.PyTreeCheckpointer() as ck:                                          # the arrays as written, no target
        raw_p, raw_o = ck.restore(run / "checkpoints" / "2" / "params"), ck.restore(run / "checkpoints" / "2" / "opt_state")
    cfg = ModelConfig(**json.loads((run / "model_config.json").read_text()))
    params_like = nnx.state(Decoder(cfg), nnx.Param)
    opt_like = make_optimizer(load_config("sft", [f"base_output_directory={tmp_path}", *OLD_ARGS])).init(params_like)
    mgr = checkpoint_manager(run / "checkpoints")
    assert _per_layer_step(mgr, 2)
    params, opt, meta = restore_state(mgr, params_like, opt_like)
    assert meta["step"] == 2
    for i in range(2):
        for path in (("attn", "q_proj"), ("mlp", "down_proj"), ("attn", "k_norm", "scale"), ("mlp_norm", "scale")):
            got = functools.reduce(lambda d, k: d[k], path, params["layers"])[...][i]
            want = functools.reduce(lambda d, k: d[k], path, raw_p["layers"][str(i)])["value"]
            np.testing.assert_array_equal(np.asarray(got), want)
            got_nu = functools.reduce(lambda d, k: d[k], path, opt[1][0].nu["layers"])[...][i]
            want_nu = functools.reduce(lambda d, k: d[k], path, raw_o[1][0]["nu"]["layers"][str(i)])["value"]
            np.testing.assert_array_equal(np.asarray(got_nu), want_nu)
            assert np.abs(want_nu).max() > 0                                        # trained moments, not zeros
    np.testing.assert_array_equal(np.asarray(params["embed"][...]), raw_p["embed"]["value"])
    r = subprocess.run([sys.executable, "-m", "maxpost.cli", "sft", f"base_output_directory={tmp_path}", *OLD_ARGS, "steps=3"],
                       capture_output=True, text=True, timeout=900, cwd=ROOT,
                       env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"})   # the run's one device
    assert r.returncode == 0, r.stderr[-3000:]
    assert [m["step"] for m in read_metrics(run, "train")] == [3]                  # resumed at step 2, not restarted
    assert not _per_layer_step(checkpoint_manager(run / "checkpoints"), 3)            # the new step is stacked
