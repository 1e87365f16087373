"""The RL loop drives any `RolloutEngine`: a scripted engine (no sampling at all) stands in for the sampler, and the
trainer must ask it for this step's prompts, score exactly its replies, hand it the updated policy after every
update, and learn from what it returned."""
import jax, jax.numpy as jnp, numpy as np
from flax import nnx

from maxpost.config import load_config, run_dir
from maxpost.commands import start_trainer
from maxpost.rl import RLTrainer, RolloutEngine
from maxpost.sampling import Rollout
from maxpost.rundir import read_metrics
from rewards_for_tests import starts_with_seven

GOOD, BAD = "7", "3 + 4"     # generation g of each prompt replies GOOD when g is even, BAD when odd


class ScriptedEngine:
    "A rollout engine that replies from a script and records how the trainer used it."
    def __init__(self):
        self.tok, self.calls, self.synced = None, [], []     # tok: the trainer's tokenizer, set once it has one

    def generate(self, prompt_ids, *, max_prompt_length, max_completion_length, num_generations, temperature, top_k,
                 top_p, eos_ids, pad_id, seed) -> Rollout:
        self.calls.append(dict(prompt_ids=[list(p) for p in prompt_ids], G=num_generations, seed=seed))
        B, eos = len(prompt_ids) * num_generations, list(eos_ids)[0]
        P, T = max(len(p) for p in prompt_ids), max_completion_length
        pids, pmask = np.full((B, P), pad_id, np.int32), np.zeros((B, P), np.int32)
        cids, cmask = np.full((B, T), pad_id, np.int32), np.zeros((B, T), np.int32)
        text = []
        for b in range(B):
            p = list(prompt_ids[b // num_generations])
            pids[b, P - len(p):], pmask[b, P - len(p):] = p, 1
            reply = GOOD if b % num_generations % 2 == 0 else BAD
            ids = self.tok.encode(reply, add_special_tokens=False) + [eos]
            cids[b, :len(ids)], cmask[b, :len(ids)] = ids, 1
            text.append(reply)
        return Rollout(pids, pmask, cids, cmask, np.zeros((B, T), np.float32), text)

    def sync_weights(self, model) -> float:
        self.synced.append(jax.tree.map(np.array, nnx.state(model, nnx.Param)))    # a copy of the weights it was given
        return 0.0


def test_the_rl_loop_drives_a_scripted_engine(tmp_path):
    cfg = load_config("rl", [f"base_output_directory={tmp_path}", "run_name=t", "load_parameters_path=", "model_name=tiny",
                             "global_batch_size=8", "num_generations=4", "mini_batch_size=0", "max_prompt_length=96",
                             "max_completion_length=12", "eval_interval=0", "eval_num_prompts=2", "eval_k=0",
                             "train_split=train[:64]", "learning_rate=3e-3", "log_period=1", "steps=3", "beta=0",
                             "reward_isolation=thread"])
    engine = ScriptedEngine()
    assert isinstance(engine, RolloutEngine)
    tr = start_trainer(RLTrainer, cfg, reward_fns=[(starts_with_seven, 1.0, "seven")], engine=engine)
    engine.tok = tr.tokenizer
    init = jax.tree.map(jnp.copy, tr.params)
    tr.fit(progress=False)

    # one generate call per step, for B / G prompts with G generations each, a fresh seed each step
    assert len(engine.calls) == cfg.steps
    assert all(len(c["prompt_ids"]) == cfg.global_batch_size // cfg.num_generations and c["G"] == cfg.num_generations
               for c in engine.calls)
    assert len({c["seed"] for c in engine.calls}) == cfg.steps
    assert engine.calls[0]["prompt_ids"] != engine.calls[1]["prompt_ids"]          # the prompts move on
    # the updated policy is handed to the engine after every update
    assert len(engine.synced) == cfg.steps
    leaves = lambda t: jax.tree.leaves(t)
    for a, b in zip(leaves(engine.synced[-1]), leaves(tr.params)): np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(leaves(engine.synced[0]), leaves(init)))
    # the rewards are the script's: half of every group replies GOOD
    logged = [m for m in read_metrics(run_dir(cfg)) if "reward" in m]
    assert len(logged) == cfg.steps
    good, bad = (len(tr.tokenizer.encode(s, add_special_tokens=False)) + 1 for s in (GOOD, BAD))
    for m in logged:
        assert m["reward"] == 0.5 and m["rewards/seven/mean"] == 0.5 and m["frac_reward_zero_std"] == 0.0
        assert m["completions/mean_length"] == (good + bad) / 2 and m["completions/clipped_ratio"] == 0.0
    # and the policy learned from them: the rewarded reply gained log-probability against the other one
    b, even = tr.last_batch, np.arange(cfg.global_batch_size) % 2 == 0
    def margin(params):
        lp = (np.asarray(tr.logps_fn(params, tr.rest, b)) * b["completion_mask"]).sum(1)
        return lp[even].mean() - lp[~even].mean()
    assert margin(tr.params) > margin(init) + 1.0
