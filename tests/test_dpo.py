"""maxpost.dpo's preference data: a pair's prompt and replies are the conversation's own tokens, split where the
template's generation prompt ends; implicit prompts; truncation as TRL keeps it."""
import random

import numpy as np, pytest

from maxpost import tasks
from maxpost.dpo import encode_pair, embedded_pair, extract_prompt, preference_batch
from maxpost.commands import start_trainer


@pytest.fixture(scope="module")
def tok():
    return tasks.build_tokenizer()


def test_prompt_plus_reply_is_the_whole_conversation_tokenized(tok):
    """For every embedded pair, prompt ids + reply ids equal the ids of the whole rendered conversation tokenized at
    once (no token is split or merged at the boundary), for the chosen and the rejected reply."""
    rng = random.Random(0)
    for row in tasks.generate_problems(40, seed=3):
        pair = embedded_pair(row, rng)
        e = encode_pair(tok, pair)
        for key, reply in (("chosen_ids", pair["chosen"]), ("rejected_ids", pair["rejected"])):
            whole = tok.apply_chat_template(pair["prompt"] + reply, tokenize=False)
            assert e["prompt_ids"] + e[key] == list(tok(whole, add_special_tokens=False)["input_ids"])


def test_string_pairs_end_with_eos_and_share_an_implicit_prompt(tok):
    e = encode_pair(tok, {"chosen": "Mia has 3 apples so 3", "rejected": "Mia has 3 apples so 4"})
    assert e["chosen_ids"][-1] == tok.eos_token_id == e["rejected_ids"][-1]
    assert tok.decode(e["prompt_ids"]).endswith("so ")
    assert extract_prompt("a b c", "a b d") == ("a b ", "c", "d")


def test_truncation_keeps_the_end_of_the_prompt_and_the_start_of_the_replies(tok):
    pair = embedded_pair(tasks.generate_problems(1, seed=1)[0], random.Random(1))
    full, short = encode_pair(tok, pair), encode_pair(tok, pair, max_prompt_length=5, max_completion_length=4)
    assert short["prompt_ids"] == full["prompt_ids"][-5:] and short["chosen_ids"] == full["chosen_ids"][:4]
    assert short["truncated"] and not full["truncated"]
    b = preference_batch([full, short], tok.pad_token_id, 128, 96)
    assert b["completion_mask"].sum(1).tolist() == [len(full["chosen_ids"]), len(full["rejected_ids"]), 4, 4]
    assert (b["prompt_mask"].sum(1) == [len(full["prompt_ids"])] * 2 + [5, 5]).all()


# ---- the trainer: DPO at initialisation through the real step, parity with TRL, the CLI

import json, os, signal, subprocess, sys, time
from pathlib import Path

import jax, jax.numpy as jnp, optax
from flax import nnx

from maxpost.config import load_config
from maxpost.dpo import DPOTrainer, make_dpo_loss, preference_options
from maxpost.sampling import completion_logps
from maxpost.rundir import read_metrics
from maxpost.checkpoint import checkpoint_manager, restore_state, hf_state_dict
from maxpost.model import create_model, get_model_config

ROOT = Path(__file__).resolve().parent.parent
TINY = ["load_parameters_path=", "model_overrides={num_layers: 2, d_model: 64, mlp_dim: 128}", "max_prompt_length=64",
        "max_completion_length=64", "train_split=train[:64]", "eval_split=test[:8]", "eval_batches=1",
        "eval_num_prompts=0", "log_period=1", "warmup_steps=0"]


def _reply_logps(model, b, i):
    "The summed log-prob of row i's reply, the row alone through the model (no prompt shared with another row)."
    keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
    return completion_logps(model, *(jnp.asarray(b[k][i:i + 1]) for k in keys)).sum()


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_at_initialisation_loss_is_log2_and_the_margin_gradient_is_minus_half_beta(tmp_path, beta):
    """policy = reference: the trainer's own step (built by build_steps, here on SGD at learning rate 1, so the
    update is minus the gradient) reports loss log 2 and margin 0, and moves the weights by beta/2 times the gradient
    of the mean log-ratio margin h = mean(log pi(y_w) - log pi(y_l)) (the reference's term is constant), h computed
    independently, one reply at a time."""
    cfg = load_config("dpo", [f"base_output_directory={tmp_path}", "run_name=init", f"beta={beta}",
                              "global_batch_size=4", *TINY], base=None)
    tr = start_trainer(DPOTrainer, cfg, progress=False)
    tr.tx = optax.sgd(1.0); tr.opt_state = tr.tx.init(tr.params); tr.build_steps()
    b = tr.batch_of(tr.train_data, [5, 2, 7, 1])
    p0 = jax.tree.map(np.asarray, tr.params)

    def margin(params):
        model = nnx.merge(tr.graphdef, params, tr.rest)
        s = [_reply_logps(model, b, i) for i in range(8)]
        return sum(s[2 * i] - s[2 * i + 1] for i in range(4)) / 4
    g = jax.jit(jax.grad(margin))(tr.params)   # one program, not a scan compiled per reply and pass
    m = tr.update(b)
    assert abs(m["loss"] - np.log(2)) < 1e-5 and abs(m["rewards/margins"]) < 1e-5
    for a, c, d in zip(jax.tree.leaves(p0), jax.tree.leaves(tr.params), jax.tree.leaves(g)):
        np.testing.assert_allclose(np.asarray(c) - a, beta / 2 * np.asarray(d), atol=2e-6, rtol=1e-3)


def test_lora_reference_is_the_base_with_adapters_off(tmp_path):
    """Under LoRA the reference is the zero adapters (no copy of the base), and it equals the base model's own
    log-probs: at initialisation the loss is log 2."""
    cfg = load_config("dpo", [f"base_output_directory={tmp_path}", "run_name=lora", "lora_rank=4",
                              "global_batch_size=4", *TINY], base=None)
    tr = start_trainer(DPOTrainer, cfg, progress=False)
    assert all(not np.asarray(x).any() for x in jax.tree.leaves(tr.ref_params))
    n_ref = sum(np.size(x) for x in jax.tree.leaves(tr.ref_params))
    assert n_ref < sum(np.size(x) for x in jax.tree.leaves(tr.rest)) / 4        # adapter-sized, no base copy
    b = tr.batch_of(tr.train_data, [0, 1, 2, 3])
    from maxpost.lora import merge_lora
    base = merge_lora(tr.model)                                                  # zero adapters merged: the base
    ref = [float(_reply_logps(base, b, i)) for i in range(8)]
    np.testing.assert_allclose(b["ref_logps"], ref, rtol=1e-4)
    assert abs(tr.update(b)["loss"] - np.log(2)) < 1e-5


# ---- parity with TRL's DPOTrainer

def _hf_base(path, seed=0):
    "A tiny random Qwen3 (vocab 512: the embedded tokenizer fits) saved with the embedded tokenizer."
    import torch, transformers
    cfg = transformers.Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                                   max_position_embeddings=512, initializer_range=0.1)
    torch.manual_seed(seed)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(path)
    tasks.build_tokenizer(path)
    return path


TRL_STEPS, TRL_PAIRS = 6, 4
GRAD_NAMES = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight",
              "model.layers.1.mlp.down_proj.weight", "model.layers.1.input_layernorm.weight", "model.norm.weight")


def test_matches_trl_dpo_trainer(tmp_path):
    """TRL's DPOTrainer (trl 1.16, in the dev extra) and maxpost's on the same tiny random Qwen3, the same pairs in
    the same order (the token ids are checked equal first): the loss and the gradients of named weights at step 1,
    then the losses of several AdamW steps."""
    trl = pytest.importorskip("trl")
    import torch, transformers, datasets
    base = _hf_base(tmp_path / "base")
    rng = random.Random(0)
    rows = [embedded_pair(r, rng) for r in tasks.generate_problems(TRL_STEPS * TRL_PAIRS + 4, seed=11)]
    rows = [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows]
    for name, part in (("train", rows[:-4]), ("held", rows[-4:])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    opt = dict(lr=1e-3, beta=0.1)
    cfg = load_config("dpo", [f"base_output_directory={tmp_path}", "run_name=ours", f"load_parameters_path={base}",
                              f"dataset_name={tmp_path / 'train.jsonl'}", f"eval_dataset_name={tmp_path / 'held.jsonl'}",
                              "eval_split=train", f"global_batch_size={TRL_PAIRS}", f"learning_rate={opt['lr']}",
                              "lr_schedule=constant", "warmup_steps=0", "weight_decay=0", "max_grad_norm=1.0",
                              f"beta={opt['beta']}", "max_prompt_length=256", "max_completion_length=256",
                              "eval_num_prompts=0", f"steps={TRL_STEPS}"], base=None)
    ours = start_trainer(DPOTrainer, cfg, progress=False)

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(base)
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=TRL_PAIRS, learning_rate=opt["lr"],
                         lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
                         beta=opt["beta"], max_length=None, report_to="none", use_cpu=True, save_strategy="no",
                         bf16=False)   # TRL 1.16 defaults to bf16 autocast, which it applies to the reference model
    theirs = trl.DPOTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows[:-4]),
                            processing_class=tok)
    optim = torch.optim.AdamW(model.parameters(), lr=opt["lr"], betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    ours_losses, trl_losses = [], []
    for step in range(TRL_STEPS):
        idx = list(range(step * TRL_PAIRS, (step + 1) * TRL_PAIRS))
        ex = [theirs.train_dataset[i] for i in idx]
        for i, e in zip(idx, ex):   # the same tokens on both sides
            mine = ours.train_data.encoded(i)
            assert (mine["prompt_ids"], mine["chosen_ids"], mine["rejected_ids"]) == \
                   (e["prompt_ids"], e["chosen_ids"], e["rejected_ids"])
        inputs = theirs.data_collator(ex)
        model.train(); optim.zero_grad()
        loss = theirs.compute_loss(model, inputs)
        loss.backward()
        b = ours.batch_of(ours.train_data, idx)
        if step == 0:
            arrays = {k: jnp.asarray(v) for k, v in b.items() if k != "truncated"}
            grads = jax.grad(lambda p: make_dpo_loss(ours.graphdef, preference_options(cfg))(p, ours.rest, arrays)[0])(ours.params)
            g_ours = hf_state_dict(nnx.merge(ours.graphdef, grads, ours.rest))
            g_trl = dict(model.named_parameters())
            for name in GRAD_NAMES:
                t = g_trl[name].grad.numpy()
                np.testing.assert_allclose(g_ours[name], t, atol=1e-4 * np.abs(t).max(), rtol=0, err_msg=name)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        trl_losses.append(float(loss))
        ours_losses.append(float(ours.update(b)["loss"]))
    print('maxpost', ours_losses, '\nTRL    ', trl_losses)
    np.testing.assert_allclose(ours_losses[0], trl_losses[0], rtol=1e-5)
    # float32 sums in another order on each side (~1e-6 relative at step 1) enter AdamW, whose per-coordinate
    # normalisation makes a small relative change of a small gradient coordinate a change of its update: measured
    # 2e-5 relative after 6 steps (the loss falls 0.69 -> 0.0008); 1e-4 leaves a factor 5
    np.testing.assert_allclose(ours_losses, trl_losses, rtol=1e-4)
    assert trl_losses[-1] < trl_losses[0] - 0.05          # training moved the loss: the comparison is not of constants


# ---- the CLI: sft then dpo with no data arguments, kill and resume, a typo

SFT_SMALL = ["model_name=tiny", "train_split=train[:256]", "eval_split=test[:16]", "global_batch_size=8",
             "max_target_length=160", "eval_batches=1", "warmup_steps=2", "learning_rate=3e-3", "log_period=1"]
DPO_SMALL = ["train_split=train[:256]", "eval_split=test[:16]", "global_batch_size=4", "eval_batches=1",
             "eval_num_prompts=4", "log_period=1", "learning_rate=1e-4", "checkpoint_period=2"]


def _cli(kind, base, *args):
    return [sys.executable, "-m", "maxpost.cli", kind, f"base_output_directory={base}", *args]


def test_cli_sft_then_dpo_resumes_after_kill_to_the_same_metrics(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    run = lambda cmd: subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    r = run(_cli("sft", tmp_path, "steps=4", *SFT_SMALL))
    assert r.returncode == 0, r.stderr[-3000:]
    steps = 8
    r = run(_cli("dpo", tmp_path, "run_name=whole", f"steps={steps}", *DPO_SMALL))   # load_parameters_path: the SFT run
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rewards/accuracies=" in r.stdout and "pass@1=" in r.stdout
    p = subprocess.Popen(_cli("dpo", tmp_path, "run_name=killed", f"steps={steps}", *DPO_SMALL), env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ck = tmp_path / "killed" / "checkpoints"
    deadline = time.time() + 600
    while time.time() < deadline and not (ck / "4").exists() and p.poll() is None: time.sleep(0.01)
    p.send_signal(signal.SIGKILL); p.wait()
    done = sorted(int(d.name) for d in ck.iterdir() if d.name.isdigit())
    assert done and max(done) < steps, f"the run finished before it could be killed: {done}"
    r = run(_cli("dpo", tmp_path, "run_name=killed", f"steps={steps}", *DPO_SMALL))
    assert r.returncode == 0, r.stderr[-3000:]
    like = nnx.state(create_model(get_model_config("tiny")), nnx.Param)
    a = restore_state(checkpoint_manager(tmp_path / "whole" / "checkpoints"), like)[0]
    b = restore_state(checkpoint_manager(tmp_path / "killed" / "checkpoints"), like)[0]
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)): np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    whole, killed = read_metrics(tmp_path / "whole", "train"), read_metrics(tmp_path / "killed", "train")
    assert [r["step"] for r in whole] == [r["step"] for r in killed] == list(range(1, steps + 1))
    keys = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected", "grad_norm")
    for x, y in zip(whole, killed):
        assert {k: x[k] for k in keys} == {k: y[k] for k in keys}, (x["step"], x, y)
    ev = read_metrics(tmp_path / "whole", "eval")
    assert {"eval_loss", "eval_rewards/accuracies", "pass@1"} <= set(ev[-1]) and ev[0]["step"] == 0
    assert abs(ev[0]["eval_loss"] - np.log(2)) < 1e-5          # before training the policy is its reference


def test_cli_config_typo_exits_2(tmp_path):
    r = subprocess.run(_cli("dpo", tmp_path, "bta=0.2"), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "unknown key 'bta'" in r.stderr and "'beta'" in r.stderr, r.stderr[-2000:]
    r = subprocess.run(_cli("dpo", tmp_path, "loss_type=dpo"), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "loss_type='dpo'" in r.stderr and "sigmoid" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "embedded-dpo").exists()


def test_papermill_dpo_run_and_a_misspelt_parameter(tmp_path):
    """nbs/runs/dpo.ipynb runs a few steps from its parameters and records TRL's metrics; `-p bta 0.2` stops it
    before training with the configuration's error naming the key it resembles."""
    import papermill as pm
    nb, runs = str(ROOT / "nbs" / "runs" / "dpo.ipynb"), tmp_path / "runs"
    with pytest.raises(pm.PapermillExecutionError) as e:
        pm.execute_notebook(nb, str(tmp_path / "bad.ipynb"), parameters={"bta": 0.2, "base_output_directory": str(runs)},
                            cwd=str(tmp_path), kernel_name="python3", progress_bar=False)
    assert e.value.ename == "ConfigError" and "unknown key 'bta'" in e.value.evalue and "'beta'" in e.value.evalue
    assert not runs.exists()
    pm.execute_notebook(nb, str(tmp_path / "out.ipynb"), cwd=str(tmp_path), kernel_name="python3", progress_bar=False,
                        parameters=dict(base_output_directory=str(runs), run_name="pm", steps=2, load_parameters_path="",
                                        global_batch_size=4, eval_num_prompts=2, eval_batches=1,
                                        overrides=["train_split=train[:32]", "eval_split=test[:8]"]))
    recs = read_metrics(runs / "pm", "train")
    assert [r["step"] for r in recs] == [1, 2] and "rewards/margins" in recs[-1]


# issue 43 item 2: preference data checked whole before the first step; truncation counted as SFT counts it
def _pairs_file(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


GOOD = [{"prompt": f"What is {i} + 1?", "chosen": f"It is {i + 1}.", "rejected": f"It is {i + 2}."} for i in range(6)]


@pytest.mark.parametrize("bad, column, word", [
    ({"prompt": "2 + 2?", "chosen": "", "rejected": "5"}, "good", "is empty"),
    ({"prompt": "2 + 2?", "chosen": None, "rejected": "5"}, "good", "is null"),
    ({"prompt": "2 + 2?", "chosen": "4", "rejected": None}, "bad", "is null"),
    ({"prompt": "2 + 2?", "chosen": "4", "rejected": "4"}, "good", "is the same as rejected"),   # with a prompt column
    ({"chosen": "2 + 2 = 4", "rejected": "2 + 2 = 4"}, "good", "is the same as rejected"),        # without one
    ({"prompt": "2 + 2?", "chosen": [{"role": "assistant", "content": " "}], "rejected": "5"}, "good", "ends with an empty turn"),
])
def test_a_bad_pair_anywhere_stops_the_run_before_the_first_step(tok, bad, column, word):
    """The bad row is the last one, after every batch a short run would draw: it is found when the data is made,
    in one line naming the row, the column (as the data names it) and the fix."""
    from maxpost.config import ConfigError
    from maxpost.dpo import PairData
    with pytest.raises(ConfigError) as e:
        PairData([*GOOD, bad], tok, 64, 64, what="train pairs", columns={"chosen": "good", "rejected": "bad"})
    msg = str(e.value)
    assert "\n" not in msg and "train pairs, row 6" in msg and f"column {column!r} {word}" in msg, msg
    assert "drop the row" in msg, msg


def test_prompts_cut_to_max_prompt_length_are_counted_and_reported(tok):
    """Every prompt longer than max_prompt_length is counted (against a count from the tokenizer itself), and the
    summary line says how many and how to keep them whole."""
    from maxpost.dpo import PairData
    rows = [{"prompt": " ".join(["word"] * n), "chosen": "yes", "rejected": "no"} for n in (2, 30, 3, 50, 40)]
    full = [len(tok(r["prompt"])["input_ids"]) for r in rows]
    limit = 20
    data = PairData(rows, tok, limit, 64, what="train pairs")
    assert data.prompts_truncated == sum(n > limit for n in full) == 3
    assert data.replies_truncated == 0 and data.longest[0] == max(full)
    line = data.summary()
    assert f"3 prompts truncated to max_prompt_length={limit}" in line and "raise max_prompt_length" in line, line
    assert PairData(rows, tok, 512, 64).prompts_truncated == 0
    assert PairData(rows, tok, 512, 1).replies_truncated == len(rows)   # every reply has >= 2 tokens with its EOS


def test_cli_dpo_bad_row_exits_2_with_one_line(tmp_path):
    """`maxpost dpo` on a file whose 7th pair has a null chosen reply: exit 2, one line naming the row and column,
    no traceback, no step trained."""
    data = _pairs_file(tmp_path / "pairs.jsonl", [*GOOD, {"prompt": "2 + 2?", "chosen": None, "rejected": "5"}])
    held = _pairs_file(tmp_path / "held.jsonl", GOOD)
    tasks.build_tokenizer().save_pretrained(tmp_path / "tok")
    r = subprocess.run(_cli("dpo", tmp_path / "out", f"dataset_name={data}", f"eval_dataset_name={held}", "eval_split=train",
                            "load_parameters_path=", f"tokenizer_path={tmp_path / 'tok'}", "model_overrides={num_layers: 1}",
                            "global_batch_size=2", "steps=1", "eval_num_prompts=0"),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "row 6 (counting from 0): column 'chosen' is null" in r.stderr, r.stderr[-3000:]
    assert not list((tmp_path / "out").glob("*/checkpoints/*"))


def test_the_default_dpo_run_directory_names_dpo_not_sigmoid():
    from maxpost.config import load_config
    import maxpost.dpo  # noqa: F401  (registers the kind and its run-name resolver)
    assert load_config("dpo").run_name == "embedded-dpo"
    assert load_config("dpo", ["loss_type=orpo"]).run_name == "embedded-orpo"


def test_the_update_and_the_reference_pass_compile_ahead_and_are_the_programs_used(tmp_path):
    "DPO starts compiling its update and its reference pass on threads when the trainer is built (before the reference's log-probs and the first evaluation), from the first batch's shapes; the first real calls take those programs: nothing is compiled again, nothing left pending."
    cfg = load_config("dpo", [f"base_output_directory={tmp_path}", "run_name=ahead", "global_batch_size=4", "steps=1",
                              "eval_interval=0", "eval_num_prompts=0", *TINY], base=None)
    tr = start_trainer(DPOTrainer, cfg, progress=False)
    assert len(tr.step_fn.ahead) == 1 and len(tr.ref_fn.ahead) == 1      # started at construction
    tr.fit(progress=False)
    for fn in (tr.step_fn, tr.ref_fn):
        assert fn.ahead == {} and len(fn.programs) == 1                # the ahead program was the one called
