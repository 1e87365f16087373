"""LoRA: peft round trips both ways on a tiny random transformers model, the base untouched by training, the
factors' gradients against a naive merged-weight implementation, an adapter-sized optimizer state, the RL
reference as the base without a copy, kill-and-resume bit-exact through the CLI, and the errors a user meets."""
import json, os, signal, subprocess, sys, time
from pathlib import Path

import jax, jax.numpy as jnp, numpy as np, pytest
from flax import nnx

from maxpost.config import load_config, run_dir, ConfigError
from maxpost.commands import start_trainer
from maxpost.checkpoint import load_hf, checkpoint_manager, restore_state
from maxpost.policy import attach_adapters
from maxpost.lora import add_lora, load_adapter, merge_lora, split_adapters, LORA_TARGETS
from maxpost.model import get_model_config, create_model
from maxpost import sharding

torch = pytest.importorskip("torch")   # torch, transformers and peft are in the dev extra: CI has them
import transformers, peft

SMALL = ["model_name=tiny", "train_split=train[:128]", "eval_split=test[:8]", "global_batch_size=8",
         "max_target_length=96", "log_period=1", "eval_batches=1", "warmup_steps=0", "learning_rate=1e-2"]


def _hf_base(path, seed=0):
    "A tiny random Qwen3 (vocab 512: the embedded tokenizer fits) saved with the embedded tokenizer."
    from maxpost.tasks import build_tokenizer
    cfg = transformers.Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                                   max_position_embeddings=256, initializer_range=0.1)
    torch.manual_seed(seed)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(path)
    build_tokenizer(path)
    return path


def _torch_logits(model, tokens):
    with torch.no_grad(): return model(input_ids=torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


TOKENS = np.random.default_rng(0).integers(1, 512, (2, 12)).astype(np.int32)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    "A maxpost LoRA SFT run of 3 steps from a tiny Hugging Face base, with save_adapter and save_hf."
    from maxpost.sft import SFTTrainer
    tmp = tmp_path_factory.mktemp("lora")
    base = _hf_base(tmp / "base")
    cfg = load_config("sft", [f"base_output_directory={tmp}", "run_name=sft_lora", f"load_parameters_path={base}",
                              "steps=3", "lora_rank=4", "lora_alpha=8", "save_adapter=true", "save_hf=true", *SMALL])
    tr = start_trainer(SFTTrainer, cfg, progress=False)
    rest0 = [np.asarray(x) for x in jax.tree.leaves(tr.rest)]
    tr.fit(progress=False)
    return tr, cfg, base, rest0


def test_maxpost_adapter_loads_in_peft_with_the_same_logits(trained):
    tr, cfg, base, _ = trained
    ours = np.asarray(tr.model(jnp.asarray(TOKENS)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(base).float().eval()
    before = _torch_logits(hf, TOKENS)
    adapted = peft.PeftModel.from_pretrained(hf, run_dir(cfg) / "adapter").eval()
    np.testing.assert_allclose(_torch_logits(adapted, TOKENS), ours, atol=1e-4)
    assert np.abs(ours - before).max() > 1e-3          # the adapters did learn something: the check is not vacuous
    merged = transformers.AutoModelForCausalLM.from_pretrained(run_dir(cfg) / "hf").float().eval()
    np.testing.assert_allclose(_torch_logits(merged, TOKENS), ours, atol=1e-4)   # save_hf wrote the merged model


def test_the_runs_adapter_names_its_base_by_a_path_that_loads_anywhere(trained, tmp_path, monkeypatch, capsys):
    """issue 31, item 5: the adapter a run exports names the Hugging Face directory it started from by its absolute
    path, even when the run was given a relative one (which does not load from another directory), says so in its
    README, and the run says that it wrote it."""
    import dataclasses
    tr, cfg, base, _ = trained
    monkeypatch.chdir(Path(base).parent)
    relative = dataclasses.replace(cfg, load_parameters_path=os.path.relpath(base), save_hf=False)
    tr.weights.export(tr.model, relative, tr.tokenizer, tmp_path)
    named = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert named == os.path.abspath(base), named
    assert os.path.abspath(base) in (tmp_path / "adapter" / "README.md").read_text()
    assert f"wrote the peft adapter to {tmp_path / 'adapter'}" in capsys.readouterr().err


def test_training_leaves_the_base_bit_identical_and_the_optimizer_adapter_sized(trained):
    tr, _, base, rest0 = trained
    after = [np.asarray(x) for x in jax.tree.leaves(tr.rest)]
    assert all(np.array_equal(a, b) for a, b in zip(rest0, after))
    fresh = nnx.state(load_hf(base), nnx.Param)
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(after, jax.tree.leaves(fresh)))
    smallest_base = min(x.size for x in after if x.ndim >= 3)       # the stacks [L, ...] of the layers' matrices
    assert max(x.size for x in jax.tree.leaves(tr.opt_state)) < smallest_base
    assert {type(v) for v in jax.tree.leaves(nnx.state(tr.model, nnx.LoRAParam), is_leaf=lambda x: isinstance(x, nnx.Variable))} == {nnx.LoRAParam}


@pytest.mark.parametrize("rslora", [False, True])
def test_peft_made_adapter_loads_in_maxpost_with_the_same_logits(tmp_path, rslora):
    base = _hf_base(tmp_path / "base", seed=1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base).float().eval()
    before = _torch_logits(hf, TOKENS)
    lc = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                         init_lora_weights=False, use_rslora=rslora)    # random, non-zero B
    adapted = peft.get_peft_model(hf, lc).eval()
    adapted.save_pretrained(tmp_path / "adapter")
    theirs = _torch_logits(adapted, TOKENS)
    ours = load_adapter(add_lora(load_hf(base), 4, 16, "q_proj,v_proj,o_proj,down_proj", rslora=rslora), tmp_path / "adapter")
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(TOKENS))), theirs, atol=1e-4)
    assert np.abs(theirs - before).max() > 1e-3
    with pytest.raises(ValueError, match="lora_target_modules=q_proj,v_proj,o_proj,down_proj"):
        load_adapter(add_lora(load_hf(base), 4, 16, rslora=rslora), tmp_path / "adapter")
    # the same through a run's keys: load_adapter_path starts the trainer's adapters from it
    keys = [f"base_output_directory={tmp_path}", "run_name=x", f"load_parameters_path={base}", "lora_rank=4",
            "lora_alpha=16", f"lora_use_rslora={rslora}", "lora_target_modules=q_proj,v_proj,o_proj,down_proj",
            f"load_adapter_path={tmp_path / 'adapter'}"]
    g, ad, rest, _ = attach_adapters(load_config("sft", keys), load_hf(base), None)
    np.testing.assert_allclose(np.asarray(nnx.merge(g, ad, rest)(jnp.asarray(TOKENS))), theirs, atol=1e-4)
    with pytest.raises(ConfigError, match="load_adapter_path=.*set lora_rank=4"):
        attach_adapters(load_config("sft", [*keys, "lora_rank=8"]), load_hf(base), None)


@pytest.mark.parametrize("remat", ["none", "minimal"])
def test_factor_gradients_equal_the_merged_weight_formula(remat):
    "d loss / d(A, B) through (x A) B inside the projections equals autodiff of the textbook W + s A B model."
    cfg = get_model_config("tiny", num_layers=2, d_model=32, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=48,
                           vocab_size=64, remat=remat)
    model = add_lora(create_model(cfg, seed=0), rank=3, alpha=6.0)
    g, ad, rest = split_adapters(model)
    ad = jax.tree.map(lambda x: jax.random.normal(jax.random.key(x.size), x.shape) * 0.2, ad)
    tok = jnp.asarray(TOKENS % 64)
    w = jax.random.normal(jax.random.key(1), (2, 12, 64))
    def naive(ad):   # a plain model (the same base: same seed) whose weights are W + s A B: no adapter in the forward
        m, plain = nnx.merge(g, ad, rest), create_model(cfg, seed=0)
        for layer, pl in zip(m.layers, plain.layers):
            for n in LORA_TARGETS:
                blk = "attn" if n in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                l, W = getattr(getattr(layer, blk), f"{n}_lora"), getattr(getattr(layer, blk), n)[...]
                r = l.a.shape[-1]
                getattr(getattr(pl, blk), n).set_value(W + l.scale * (l.a[...].reshape(-1, r) @ l.b[...].reshape(r, -1)).reshape(W.shape))
        return (plain(tok) * w).sum()
    ours = jax.grad(lambda ad: (nnx.merge(g, ad, rest)(tok) * w).sum())(ad)
    ref = jax.grad(naive)(ad)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5)


def test_rl_reference_is_the_base_without_a_copy(tmp_path):
    from maxpost.rl import RLTrainer
    from maxpost.sampling import completion_logps
    cfg = load_config("rl", [f"base_output_directory={tmp_path}", "run_name=rl_lora", "model_overrides={num_layers: 1}",
                             "load_parameters_path=", "mini_batch_size=0",
                             "lora_rank=2", "beta=0.04", "global_batch_size=4", "num_generations=2",
                             "max_prompt_length=64", "max_completion_length=8", "reward_isolation=thread",
                             "eval_num_prompts=2", "eval_k=0", "steps=1"])
    tr = start_trainer(RLTrainer, cfg)
    adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(tr.params))
    assert sum(x.nbytes for x in jax.tree.leaves(tr.ref_params)) == adapter_bytes
    assert adapter_bytes < min(x.nbytes for x in jax.tree.leaves(tr.rest) if x.ndim >= 3)   # the layers' stacked matrices
    tr.params = jax.tree.map(lambda x: x + 0.05, tr.params)               # adapters that move the policy
    b = tr.rollout()["batch"]
    dev = sharding.shard_batch(b, tr.mesh)
    with jax.set_mesh(tr.mesh):
        ref = np.asarray(tr.reference.logps(dev))                         # what the update step is given
        policy = np.asarray(tr.logps_fn(tr.params, tr.rest, dev))
    assert all(a is b for a, b in zip(jax.tree.leaves(tr.reference.rest), jax.tree.leaves(tr.rest)))   # the base is shared
    plain = create_model(tr.model_cfg, seed=cfg.seed)                     # the same preset and seed, no adapters
    want = np.asarray(completion_logps(plain, b["prompt_ids"], b["prompt_mask"], b["completion_ids"],
                                       b["completion_mask"], cfg.temperature))
    m = b["completion_mask"] > 0
    np.testing.assert_allclose(ref[m], want[m], atol=1e-5)
    assert np.abs(policy[m] - want[m]).max() > 1e-3
    tr.close()


def _sft_cmd(base, run, steps, *extra):
    return [sys.executable, "-m", "maxpost.cli", "sft", f"base_output_directory={base}", f"run_name={run}",
            f"steps={steps}", "lora_rank=4", *SMALL, *extra]


def test_cli_lora_kill_and_resume_is_bit_exact_and_a_changed_base_is_refused(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    base = _hf_base(tmp_path / "base")
    steps, extra = 8, ["checkpoint_period=2", "max_checkpoints_to_keep=3", f"load_parameters_path={base}"]
    r = subprocess.run(_sft_cmd(tmp_path, "whole", steps, *extra), env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    p = subprocess.Popen(_sft_cmd(tmp_path, "killed", steps, *extra), env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    ck = tmp_path / "killed" / "checkpoints"
    deadline = time.time() + 300
    while time.time() < deadline and not (ck / "4").exists() and p.poll() is None: time.sleep(0.01)
    p.send_signal(signal.SIGKILL); p.wait()
    done = sorted(int(d.name) for d in ck.iterdir() if d.name.isdigit())
    assert done and max(done) < steps, f"the run finished before it could be killed: {done}"
    r = subprocess.run(_sft_cmd(tmp_path, "killed", steps, *extra), env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    like = split_adapters(add_lora(load_hf(base), 4))[1]
    got = [restore_state(checkpoint_manager(tmp_path / run / "checkpoints"), like)[0] for run in ("whole", "killed")]
    for x, y in zip(jax.tree.leaves(got[0]), jax.tree.leaves(got[1])): np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert any(np.abs(np.asarray(x)).max() > 0 for x in jax.tree.leaves(got[0]))
    # the base the run was trained on changes: resuming it for more steps is refused, naming why
    from maxpost.sft import train_sft
    _hf_base(base, seed=5)
    cfg = load_config("sft", [f"base_output_directory={tmp_path}", "run_name=whole", f"steps={steps + 2}", "lora_rank=4",
                              *SMALL, *extra])
    with pytest.raises(ConfigError, match="adapters trained on another base"): train_sft(cfg, progress=False)


def test_config_errors_name_the_fix(tmp_path):
    base = [f"base_output_directory={tmp_path}", "run_name=x"]
    with pytest.raises(ConfigError, match="q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"):
        load_config("rl", [*base, "lora_rank=8", "lora_target_modules=q_proj,qkv_proj"])
    with pytest.raises(ConfigError, match="lora_dropout=0.1 is not supported"):
        load_config("sft", [*base, "lora_rank=8", "lora_dropout=0.1"])
    with pytest.raises(ConfigError, match="needs adapters: set lora_rank"):
        load_config("sft", [*base, "load_adapter_path=/tmp/a"])


def test_fresh_adapters_leave_the_model_unchanged():
    """A freshly attached adapter is a zero update (B = 0, as in the LoRA paper and peft): the adapted model's logits
    equal the base's exactly, and training starts from the base's behaviour; A is not zero (else B would get no
    gradient)."""
    cfg = get_model_config("tiny", num_layers=2, d_model=32, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=48,
                           vocab_size=64)
    tok = jnp.asarray(TOKENS % 64)
    base = np.asarray(create_model(cfg, seed=0)(tok))
    model = add_lora(create_model(cfg, seed=0), rank=4, alpha=8.0)
    np.testing.assert_array_equal(np.asarray(model(tok)), base)
    for layer in model.layers:
        for n in LORA_TARGETS:
            lora = getattr(getattr(layer, "attn" if n in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"), f"{n}_lora")
            assert not np.asarray(lora.b[...]).any() and np.asarray(lora.a[...]).any(), n


def test_the_loop_and_the_kinds_do_not_branch_on_lora():
    "LoRA is the business of `Trainer.weights` (chapter 07b_policy): the loop, resume, export and the RL reference ask it."
    import inspect
    from maxpost import train, rl, sft, dpo
    for fn in (train.Trainer.__init__, train._resume, train._fit, train._steps, train._after_steps, rl.RLTrainer.__init__, rl.RLTrainer._update,
               sft.SFTTrainer.__init__, dpo.DPOTrainer.__init__):
        src = inspect.getsource(fn)
        for name in ("lora_base", "lora_options", "attach_adapters", "check_lora_base", "adapters_off", "lora_rank",
                     "save_merged_hf", "zeros_like"):
            assert name not in src, f"{fn.__qualname__} uses {name}: it branches on LoRA itself\n{src}"
