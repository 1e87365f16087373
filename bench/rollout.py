"""Rollout throughput: generated tokens/s of maxpost's sampler vs Tunix's vanilla `Sampler` vs vLLM (CPU) vs
transformers' `generate`, at batch 1, 16 and 64.

All engines: the same random prompts (prompt length P, no padding), T new tokens per row with EOS disabled so that
every engine produces exactly B x T tokens, temperature 1.0 with no top-k / top-p, fp32 weights and KV cache.
maxpost, Tunix and vLLM also return each sampled token's log-prob (what RL needs); transformers' generate does not.
Timed: one whole call from prompt ids to host-side completion ids, after one warmup call (compilation / graph capture).

    python bench/rollout.py                       # tiny and 20m shapes, batch 1 16 64, P 32, T 128
    python bench/rollout.py --shapes 20m --rounds 3   # every engine three times, interleaved (noisy machines)
    python bench/rollout.py --quick               # tiny shape, batch 1 16, T 32
    python bench/rollout.py --worker maxpost --shape 20m --batch 64 --prompt 32 --new 128 --reps 3
"""
from __future__ import annotations
import argparse, os, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common


def hf_config(shape: str):
    from transformers import Qwen3Config
    s = common.SHAPES[shape]
    return Qwen3Config(vocab_size=s["vocab_size"], hidden_size=s["d_model"], intermediate_size=s["mlp_dim"],
                       num_hidden_layers=s["num_layers"], num_attention_heads=s["num_heads"],
                       num_key_value_heads=s["num_kv_heads"], head_dim=s["head_dim"], rope_theta=s["rope_theta"],
                       rms_norm_eps=s["norm_eps"], tie_word_embeddings=True, max_position_embeddings=4096,
                       bos_token_id=None, eos_token_id=2, pad_token_id=0, dtype="float32")


def tunix_config(shape: str):
    from tunix.models.qwen3 import model as q3
    s = common.SHAPES[shape]
    return q3.ModelConfig(num_layers=s["num_layers"], vocab_size=s["vocab_size"], embed_dim=s["d_model"],
                          hidden_dim=s["mlp_dim"], num_heads=s["num_heads"], head_dim=s["head_dim"],
                          num_kv_heads=s["num_kv_heads"], rope_theta=int(s["rope_theta"]), norm_eps=s["norm_eps"],
                          use_tied_embedding=True)


def run_maxpost(a, prompts) -> dict:
    from maxpost.model import create_model
    from maxpost.sampling import generate
    model = create_model(common.maxpost_config(a.shape), seed=0)
    seed = iter(range(10**6))
    def one():
        r = generate(model, prompts, max_prompt_length=a.prompt, max_completion_length=a.new, temperature=1.0,
                     eos_ids=(), seed=next(seed))
        return int(r.completion_mask.sum())
    return _time(a, one)


def run_tunix(a, prompts) -> dict:
    from flax import nnx
    from tunix.models.qwen3 import model as q3
    from tunix.generate import sampler as ts
    cfg = tunix_config(a.shape)
    model = q3.Qwen3(cfg, rngs=nnx.Rngs(0))
    tok = common.id_tokenizer(cfg.vocab_size, bos=False)
    smp = ts.Sampler(model, tok, ts.CacheConfig(cache_size=a.prompt + a.new, num_layers=cfg.num_layers,
                                                  num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim))
    texts = [common.ids_to_text(p) for p in prompts]
    seed = iter(range(10**6))
    def one():
        out = smp(texts, max_generation_steps=a.new, max_prompt_length=a.prompt, eos_tokens=[-1], temperature=1.0,
                  top_p=1.0, return_logprobs=True, seed=next(seed))
        return sum(len(t) for t in out.tokens)
    return _time(a, one)


def run_hf(a, prompts) -> dict:
    import torch
    from transformers import Qwen3ForCausalLM
    torch.set_num_threads(common.THREADS); torch.manual_seed(0)
    model = Qwen3ForCausalLM(hf_config(a.shape)).eval()
    ids = torch.tensor(prompts); mask = torch.ones_like(ids)
    def one():
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, max_new_tokens=a.new, min_new_tokens=a.new, eos_token_id=None,
                                 pad_token_id=0)
        return int(out[:, ids.shape[1]:].numel())
    return _time(a, one)


def vllm_model_dir(shape: str) -> Path:
    "A Hugging Face directory (random Qwen3 weights + id tokenizer) for vLLM, written once with torch."
    s = common.SHAPES[shape]   # the directory name carries the shape's numbers: an edited shape gets a new directory
    tag = "_".join(str(s[k]) for k in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "mlp_dim"))
    d = Path(os.environ.get("MAXPOST_BENCH_CACHE", "/tmp/maxpost_bench")) / f"hf_{shape}_{tag}"
    if not (d / "config.json").exists():
        import torch
        from transformers import Qwen3ForCausalLM
        torch.manual_seed(0)
        Qwen3ForCausalLM(hf_config(shape)).save_pretrained(d)
        common.id_tokenizer(common.SHAPES[shape]["vocab_size"], d, bos=False)
    return d


_LLM = {}

def run_vllm(a, prompts) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    if "llm" not in _LLM:   # one engine for every batch size; it schedules at most max(batches) sequences at once
        _LLM["llm"] = LLM(model=str(a.model_dir), dtype="float32", max_model_len=a.prompt + a.new, seed=0,
                          max_num_seqs=max(a.batches), max_num_batched_tokens=max(max(a.batches) * a.prompt, 2048))
    llm = _LLM["llm"]
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    seed = iter(range(10**6))
    def one():
        sp = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=a.new,
                            min_tokens=a.new, ignore_eos=True, logprobs=0, seed=next(seed))
        outs = llm.generate(inputs, sp, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)
    return _time(a, one)


def _time(a, one) -> dict:
    warmup, reps = (0, a.hf_reps) if a.worker == "hf" else (a.warmup - 1, a.reps)   # eager torch: nothing to compile
    return common.time_calls(one, warmup=warmup, reps=reps)


WORKERS = {"maxpost": run_maxpost, "tunix": run_tunix, "vllm": run_vllm, "hf": run_hf}


def worker(a) -> None:
    "One engine, one shape, every batch size in one process (vLLM's engine start-up is paid once)."
    out = {}
    if a.worker == "vllm": a.batch = max(a.batches)
    for b in a.batches:
        prompts = common.prompt_ids(b, a.prompt, common.SHAPES[a.shape]["vocab_size"], seed=1)
        a.batch = b
        out[str(b)] = {**WORKERS[a.worker](a, prompts), "rss_now_tree_mb": round(common.tree_rss_mb(), 1)}
    common.emit({"name": a.worker, "shape": a.shape, "prompt": a.prompt, "new": a.new, "batches": out})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=list(WORKERS))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shape", choices=list(common.SHAPES))
    ap.add_argument("--shapes", nargs="*")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--batches", type=int, nargs="*")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int)
    ap.add_argument("--hf-reps", dest="hf_reps", type=int, default=1, help="timed calls of transformers (slow)")
    ap.add_argument("--engines", nargs="*", default=["maxpost", "tunix", "vllm", "hf"])
    ap.add_argument("--model-dir", dest="model_dir")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds of all engines (noisy machines)")
    a = ap.parse_args(argv)
    a.new = a.new or (32 if a.quick else 128)
    a.reps = a.reps or (2 if a.quick else 3)
    if a.worker: worker(a); return 0

    shapes = a.shapes or (["tiny"] if a.quick else ["tiny", "20m"])
    batches = a.batches or ([1, 16] if a.quick else [1, 16, 64])
    vllm_ok = "vllm" in a.engines and Path(common.VLLM_PY).exists()
    print(f"load average before: {common.load_avg()}; threads {common.THREADS}; vLLM: "
          f"{common.VLLM_PY if vllm_ok else 'not used'}", flush=True)
    rows, recs = [], []
    for shape in shapes:
        mdir = vllm_model_dir(shape) if vllm_ok else None
        base = ["--shape", shape, "--batches", *map(str, batches), "--prompt", str(a.prompt), "--new", str(a.new),
                "--warmup", str(a.warmup), "--reps", str(a.reps), "--hf-reps", str(a.hf_reps)]
        def launch(eng):
            if eng == "vllm":
                return common.run_worker("rollout.py", ["--worker", eng, *base, "--model-dir", str(mdir)],
                                         python=common.VLLM_PY, timeout=1200, own_threads=True)
            return common.run_worker("rollout.py", ["--worker", eng, *base], timeout=1200)
        engines = [e for e in a.engines if e != "vllm" or vllm_ok]
        per_round = common.run_rounds({eng: (lambda eng=eng: launch(eng)) for eng in engines}, a.rounds)
        recs.append({"shape": shape, "rounds": per_round})
        for b in batches:
            by_round = {eng: [r["batches"][str(b)] if "error" not in r else r for r in rs]
                        for eng, rs in per_round.items()}
            for eng, rs in by_round.items():
                first_ok = next((r for r in per_round[eng] if "error" not in r), None)
                if first_ok is None:
                    rows.append({"shape": shape, "batch": b, "name": eng, "note": per_round[eng][0]["error"]}); continue
                rb = common.merge_rounds(rs, ["tokens_per_s", "median_s", "first_call_s"])
                ratios = common.paired_ratios(by_round.get("maxpost", []), rs, "tokens_per_s")
                peak = max(r["peak_rss_mb"] for r in per_round[eng] if "error" not in r)
                rss = max(peak, rb["rss_now_tree_mb"]) if eng == "vllm" else peak
                rows.append({"shape": shape, "batch": b, "name": eng, "tps": rb["tokens_per_s"], "s": rb["median_s"],
                             "ratio": common.median(ratios), "range": common.spread(ratios),
                             "first": rb["first_call_s"], "rss": rss, "load": first_ok["load_avg_after"]})
    common.print_table(f"Rollout, prompt {a.prompt}, {a.new} new tokens, temperature 1 (median of {a.reps} calls; "
                       f"{a.rounds} interleaved round(s), medians over rounds)", rows,
                       [("shape", "shape"), ("batch", "batch"), ("name", "engine"), ("tps", "gen tokens/s"),
                        ("s", "call s"), ("ratio", "maxpost / this"), ("range", "per-round range"),
                        ("first", "first call s"), ("rss", "peak RSS MiB"), ("load", "load avg after"),
                        ("note", "note")])
    common.save_results("rollout_quick" if a.quick else "rollout_" + "_".join(shapes), {"runs": recs, "args": vars(a)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
