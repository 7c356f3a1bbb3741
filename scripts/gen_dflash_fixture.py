#!/usr/bin/env python3
"""Generate the DFlash drafter fixtures tests/fixtures/dflash_zlab and tests/fixtures/dflash_mimo (run on
the GPU machine; CPU float64 is used there).

The reference is z-lab's own implementation (github.com/z-lab/dflash, dflash/model.py: DFlashDraftModel and
its dflash_generate loop). Its code is NOT part of this repository: copy it to .ref/dflash/model.py (git-ignored)
and carry .ref to the machine; this script imports it from there and calls dflash_generate unmodified.

Target: tests/fixtures/mimo_native_f32 (MiMoV2FlashForCausalLM, transformers-native config), loaded in float64
with eager attention, prompt = its reference.json prompt (48 tokens), 32 new tokens, greedy (temperature 0).

Drafters (tiny, random, float32 on disk, run in float64):
  dflash_zlab  z-lab dialect: DFlashDraftModel, 2 Qwen3 layers (hidden 64 = target hidden, 4 q / 2 kv heads,
               head_dim 16), block_size 4, dflash_config {target_layer_ids [0, 2], mask_token_id 500},
               layer_types all full_attention. The reference model is used exactly as published.
  dflash_mimo  MiMo dialect: the same reference code with MiMo's additions applied by this script (documented
               here because the z-lab model lacks them; semantics as vLLM's qwen3_dflash.py):
                 - dflash_config.use_swa + swa_window_size W=4 (< block_size 8 on purpose): every layer is
                   sliding and non-causal; a query at absolute position p sees keys j with |p - j| < W
                   (symmetric per query). The z-lab attention passes no mask (its eager/sdpa path ignores
                   `sliding_window`), so the attention forward is replaced by an explicit-mask version.
                 - dflash_config.attention_sink_bias: per-head sink logit (tensor
                   layers.N.self_attn.attention_sink_bias [n_heads]) as one extra softmax column, dropped.
                 - dflash_config.attention_value_scale 0.6: V (context and block) multiplied before caching.
                 - mask_embedding.safetensors sidecar ("mask_embedding" [hidden]): replaces the embedding of the
                   MASK slots 1..B-1 of every block (vLLM substitutes it for embed(mask_token_id)); applied by
                   wrapping DFlashDraftModel.forward.
               3 target layers [1, 3, 4], 4 q / 1 kv heads, block_size 8.

For each dialect, drafter seeds 0..N_SEEDS-1 are tried and the seed kept is the one with the most accepted
tokens among those whose every proposal has a top-1/top-2 draft-logit margin >= MIN_MARGIN (so an f32 engine
decides the same argmax); ties -> more distinct proposals (capped at 8), then larger minimum margin.

Recorded per fixture directory:
  config.json, model.safetensors     the drafter checkpoint (f32)
  mask_embedding.safetensors          (dflash_mimo only) the sidecar
  reference.json   target_fixture, prompt_ids, block_size, max_new_tokens, steps [{start, proposed [B-1],
                   margins [B-1], accepted}], output_ids (speculative greedy, max_new_tokens), greedy_ids
                   (plain greedy by full recompute: must equal output_ids), acceptance_lengths, seed, notes
  reference.safetensors  draft_logits.{s} F32 [B-1, vocab] for every step s (the target lm_head applied to the
                   drafter's normed slots 1..B-1), for tolerance-based numerics tests

Usage: PYTHONUNBUFFERED=1 python3 scripts/gen_dflash_fixture.py --out $OUT   # writes $OUT/dflash_fixtures.tar
       then: tar -xf dflash_fixtures.tar -C tests/fixtures/
"""

import argparse
import importlib
import importlib.util
import json
import math
import os
import sys
import tarfile
import time
import traceback

import torch
from torch import nn

import transformers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REF_MODEL = os.path.join(ROOT, ".ref", "dflash", "model.py")
TARGET_NAME = "mimo_native_f32"
TARGET_DIR = os.path.join(ROOT, "tests", "fixtures", TARGET_NAME)
GEN = f"transformers {transformers.__version__}, torch {torch.__version__}"
MAX_NEW_TOKENS = 32
MIN_MARGIN = 0.02
N_LOGIT_STEPS = 1000  # every step

# ----------------------------------------------------------------------------------------------
# safetensors by hand (u64 LE header length, JSON header, raw little-endian data)
# ----------------------------------------------------------------------------------------------
_DT2ST = {torch.float32: "F32", torch.float64: "F64", torch.bfloat16: "BF16", torch.int32: "I32"}


def write_safetensors(path, tensors):
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        b = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _DT2ST[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for b in blobs:
            f.write(b)


# ----------------------------------------------------------------------------------------------
# the reference, imported from .ref/
# ----------------------------------------------------------------------------------------------
def load_reference():
    if not os.path.exists(REF_MODEL):
        sys.exit(f"missing {REF_MODEL}: copy z-lab/dflash's dflash/model.py there (and carry .ref)")
    # model.py imports a few helpers through transformers' modeling_qwen3; if this transformers version
    # moved one, expose it there under the old name (no behaviour change).
    mq = importlib.import_module("transformers.models.qwen3.modeling_qwen3")
    shims = {
        "FlashAttentionKwargs": "transformers.modeling_flash_attention_utils",
        "GradientCheckpointingLayer": "transformers.modeling_layers",
        "ALL_ATTENTION_FUNCTIONS": "transformers.modeling_utils",
    }
    for name, module in shims.items():
        if not hasattr(mq, name):
            print(f"  shim: modeling_qwen3.{name} <- {module}")
            setattr(mq, name, getattr(importlib.import_module(module), name))
    spec = importlib.util.spec_from_file_location("zlab_dflash_model", REF_MODEL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def set_eager(model):
    for fn in ("set_attn_implementation", "set_experts_implementation"):
        if hasattr(model, fn):
            try:
                getattr(model, fn)("eager")
            except Exception as e:  # noqa: BLE001
                print(f"  note: {fn}('eager') failed: {e}")
    return model


def load_target():
    from transformers import MiMoV2FlashForCausalLM

    target = MiMoV2FlashForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float64, attn_implementation="eager")
    return set_eager(target).eval()


@torch.no_grad()
def plain_greedy(target, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        logits = target(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False).logits[0, -1]
        ids.append(int(torch.argmax(logits)))
    return ids[len(prompt):]


# ----------------------------------------------------------------------------------------------
# drafter configs
# ----------------------------------------------------------------------------------------------
def zlab_config():
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "vocab_size": 512,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention", "full_attention"],
        "use_sliding_window": False,
        "sliding_window": None,
        "block_size": 4,
        "num_target_layers": 6,
        "dflash_config": {"target_layer_ids": [0, 2], "mask_token_id": 500},
        "dtype": "float32",
    }


MIMO_WINDOW = 4
MIMO_VALUE_SCALE = 0.6


def mimo_config():
    c = zlab_config()
    c.update({
        "num_key_value_heads": 1,
        "intermediate_size": 80,
        "block_size": 8,
        "rope_theta": 20000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 20000.0},
        "dflash_config": {
            "target_layer_ids": [1, 3, 4],
            "mask_token_id": 511,
            "use_swa": True,
            "swa_window_size": MIMO_WINDOW,
            "attention_sink_bias": True,
            "attention_value_scale": MIMO_VALUE_SCALE,
        },
    })
    # MiMo's drafter config has no layer_types: use_swa decides (all layers sliding, non-causal).
    for key in ("layer_types", "use_sliding_window", "sliding_window"):
        c.pop(key)
    return c


def hf_config(cfg):
    from transformers import Qwen3Config

    kwargs = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "dtype", "rope_theta")}
    config = Qwen3Config(**kwargs)
    config._attn_implementation = "eager"
    return config


# ----------------------------------------------------------------------------------------------
# MiMo additions (see the module docstring)
# ----------------------------------------------------------------------------------------------
def mimo_attention_forward(ref):
    def forward(self, hidden_states, target_hidden, position_embeddings, attention_mask, past_key_values=None,
                cache_position=None, **kwargs):
        bsz, q_len = hidden_states.shape[:-1]
        ctx_len = target_hidden.shape[1]
        q = self.q_norm(self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim)).transpose(1, 2)
        k = torch.cat([self.k_proj(target_hidden), self.k_proj(hidden_states)], dim=1)
        v = torch.cat([self.v_proj(target_hidden), self.v_proj(hidden_states)], dim=1)
        k = self.k_norm(k.view(bsz, ctx_len + q_len, -1, self.head_dim)).transpose(1, 2)
        v = (v.view(bsz, ctx_len + q_len, -1, self.head_dim) * MIMO_VALUE_SCALE).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = ref.apply_rotary_pos_emb(q, k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx, {"sin": sin, "cos": cos,
                                                                  "cache_position": cache_position})
        # The draft cache is cropped to `start` before every call, so key index == absolute position and the
        # queries are the last q_len positions.
        kv_len = k.shape[2]
        qpos = torch.arange(kv_len - q_len, kv_len)
        kpos = torch.arange(kv_len)
        allowed = (qpos[:, None] - kpos[None, :]).abs() < MIMO_WINDOW
        groups = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        scores = scores.masked_fill(~allowed, float("-inf"))
        sink = self.attention_sink_bias.view(1, -1, 1, 1).expand(bsz, -1, q_len, 1).to(scores.dtype)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        out = torch.matmul(probs, v).transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(out), probs

    return forward


def apply_mimo_additions(ref, model, mask_embedding):
    import types

    fwd = mimo_attention_forward(ref)
    for layer in model.layers:
        attn = layer.self_attn
        attn.attention_sink_bias = nn.Parameter(torch.zeros(attn.q_proj.out_features // attn.head_dim))
        attn.forward = types.MethodType(fwd, attn)
    original = model.forward

    def forward(*args, **kwargs):
        noise = kwargs["noise_embedding"].clone()
        noise[:, 1:, :] = mask_embedding.to(noise.dtype)  # slots 1..B-1 are always MASK in dflash_generate
        kwargs["noise_embedding"] = noise
        return original(*args, **kwargs)

    model.forward = forward


# ----------------------------------------------------------------------------------------------
# one drafter
# ----------------------------------------------------------------------------------------------
def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            u = torch.rand(p.shape, generator=g, dtype=torch.float64) * 2 - 1
            if name.endswith("norm.weight"):
                value = 1 + 0.2 * u
            elif name.endswith("attention_sink_bias"):
                value = 1 + 2 * u
            else:  # unit-variance uniform: keeps the context's influence O(1) through the tiny layers
                value = u * math.sqrt(3.0 / p.shape[-1])
            p.copy_(value.to(torch.float32).to(p.dtype))


def build_drafter(ref, cfg, seed, mimo):
    torch.manual_seed(seed)
    model = ref.DFlashDraftModel(hf_config(cfg))
    mask_embedding = None
    if mimo:
        g = torch.Generator().manual_seed(10_000 + seed)
        mask_embedding = (torch.randn(cfg["hidden_size"], generator=g, dtype=torch.float64)).to(torch.float32)
        apply_mimo_additions(ref, model, mask_embedding.double())
    randomize(model, seed)
    state = {k: v.detach().to(torch.float32).clone() for k, v in model.state_dict().items()}
    model = model.double().eval()
    return model, state, mask_embedding


def run_reference(ref, target, model, prompt, block_size):
    steps = []
    logits_kept = []

    def hook(module, args, kwargs, output):
        out = output[:, 1 - block_size:, :]
        logits = target.lm_head(out)[0].double()  # [B-1, vocab]
        top2 = torch.topk(logits, 2, dim=-1)
        pos = kwargs["position_ids"][0]
        steps.append({
            "start": int(pos[-1]) - block_size + 1,
            "proposed": [int(t) for t in top2.indices[:, 0]],
            "margins": [float(m) for m in (top2.values[:, 0] - top2.values[:, 1])],
        })
        if len(logits_kept) < N_LOGIT_STEPS:
            logits_kept.append(logits.to(torch.float32).clone())

    # the MiMo wrapper replaced model.forward; hooks still fire because __call__ runs them around forward
    handle = model.register_forward_hook(hook, with_kwargs=True)
    try:
        stats = ref.dflash_generate(model, target, torch.tensor([prompt], dtype=torch.long), MAX_NEW_TOKENS,
                                    stop_token_ids=None, temperature=0.0, return_stats=torch.cuda.is_available())
    finally:
        handle.remove()
    if torch.cuda.is_available():
        output_ids, acceptance = stats.output_ids, list(stats.acceptance_lengths)
    else:
        output_ids, acceptance = stats, None
    out = [int(t) for t in output_ids[0, len(prompt):]]
    # accepted drafts of step s: the next step starts at start + accepted + 1
    for s in range(len(steps)):
        if s + 1 < len(steps):
            steps[s]["accepted"] = steps[s + 1]["start"] - steps[s]["start"] - 1
        else:
            full = list(prompt) + out
            a = 0
            st = steps[s]["start"]
            while a < block_size - 1 and st + 1 + a < len(full) and full[st + 1 + a] == steps[s]["proposed"][a]:
                a += 1
            steps[s]["accepted"] = a
    if acceptance is not None:
        recon = [s["accepted"] + 1 for s in steps]
        if recon[:-1] != acceptance[:-1]:  # would mean the hook misread the steps: keep the reference's counts
            print(f"  WARNING: acceptance reconstruction {recon} != reference {acceptance}")
        for s, a in zip(steps, acceptance):
            s["accepted"] = a - 1
    return out, steps, logits_kept


def make_fixture(ref, target, prompt, greedy, name, cfg, mimo, n_seeds, time_budget_s, out_root):
    block = cfg["block_size"]
    best = None
    t0 = time.time()
    for seed in range(n_seeds):
        if seed > 0 and time.time() - t0 > time_budget_s:
            print(f"  {name}: time budget reached after {seed} seeds")
            break
        model, state, mask_embedding = build_drafter(ref, cfg, seed, mimo)
        with torch.no_grad():
            out, steps, logits = run_reference(ref, target, model, prompt, block)
        min_margin = min(min(s["margins"]) for s in steps)
        accepted = sum(s["accepted"] for s in steps)
        lossless = out == greedy
        distinct = len(set(tuple(s["proposed"]) for s in steps))
        key = (lossless, min_margin >= MIN_MARGIN, accepted, min(distinct, 8), min_margin)
        print(f"  {name} seed {seed}: steps {len(steps)} accepted {accepted} distinct {distinct} "
              f"min margin {min_margin:.4f} lossless {lossless}")
        if best is None or key > best[0]:
            best = (key, seed, state, mask_embedding, out, steps, logits)
    print(f"  {name}: {n_seeds} seeds in {time.time() - t0:.1f}s; kept seed {best[1]} {best[0]}")
    _, seed, state, mask_embedding, out, steps, logits = best
    d = os.path.join(out_root, name)
    os.makedirs(d, exist_ok=True)
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"), indent=2)
    write_safetensors(os.path.join(d, "model.safetensors"), state)
    if mask_embedding is not None:
        write_safetensors(os.path.join(d, "mask_embedding.safetensors"), {"mask_embedding": mask_embedding})
    write_safetensors(os.path.join(d, "reference.safetensors"),
                      {f"draft_logits.{i}": l for i, l in enumerate(logits)})
    notes = ("z-lab dflash/model.py (commit 44947fb) DFlashDraftModel + dflash_generate, unmodified"
             if not mimo else
             "z-lab dflash/model.py (commit 44947fb) DFlashDraftModel + dflash_generate with MiMo additions applied "
             "by scripts/gen_dflash_fixture.py: all layers sliding (window %d) and non-causal with a symmetric "
             "per-query window |p - j| < W, per-head attention sinks, value scale %g, mask embedding sidecar for "
             "slots 1..B-1" % (MIMO_WINDOW, MIMO_VALUE_SCALE))
    notes += ("; target %s in float64 (eager), drafter f32 weights run in float64; drafts are argmax of the target "
              "lm_head on the drafter's slots 1..B-1; margins = top1 - top2 draft logit" % TARGET_NAME)
    ref_json = {
        "generator": GEN,
        "target_fixture": TARGET_NAME,
        "prompt_ids": prompt,
        "block_size": block,
        "max_new_tokens": MAX_NEW_TOKENS,
        "seed": seed,
        "steps": steps,
        "acceptance_lengths": [s["accepted"] + 1 for s in steps],
        "output_ids": out,
        "greedy_ids": greedy,
        "notes": notes,
    }
    json.dump(ref_json, open(os.path.join(d, "reference.json"), "w"), indent=1)
    return {"seed": seed, "steps": len(steps), "accepted": sum(s["accepted"] for s in steps),
            "min_margin": min(min(s["margins"]) for s in steps), "lossless": out == greedy}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seeds", type=int, default=40)
    ap.add_argument("--budget", type=float, default=70.0, help="seconds of seed search per fixture")
    args = ap.parse_args()
    torch.set_num_threads(min(8, os.cpu_count() or 1))
    summary = {"generator": GEN, "fixtures": {}, "errors": []}
    work = os.path.join(args.out, "fixtures")
    os.makedirs(work, exist_ok=True)
    ref = load_reference()
    target = load_target()
    golden = json.load(open(os.path.join(TARGET_DIR, "reference.json")))
    prompt = golden["prompt_ids"]
    t0 = time.time()
    greedy = plain_greedy(target, prompt, MAX_NEW_TOKENS)
    print(f"plain greedy {time.time() - t0:.1f}s; equals golden greedy_ids: {greedy == golden['greedy_ids']}")
    summary["plain_greedy_equals_golden"] = greedy == golden["greedy_ids"]
    for name, cfg, mimo in (("dflash_zlab", zlab_config(), False), ("dflash_mimo", mimo_config(), True)):
        try:
            summary["fixtures"][name] = make_fixture(ref, target, prompt, greedy, name, cfg, mimo, args.seeds,
                                                      args.budget, work)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            summary["errors"].append(f"{name}: {e!r}")
    with tarfile.open(os.path.join(args.out, "dflash_fixtures.tar"), "w") as tar:
        for name in sorted(os.listdir(work)):
            tar.add(os.path.join(work, name), arcname=name)
    json.dump(summary, open(os.path.join(args.out, "summary.json"), "w"), indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
