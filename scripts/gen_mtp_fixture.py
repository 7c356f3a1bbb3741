#!/usr/bin/env python3
"""MTP-drafter reference for MiMo-V2-Flash (run on the GPU machine; CPU is enough).

Builds tests/fixtures/mimo_mtp_f32: the mimo_hub_f32 checkpoint (same config, same target and MTP
block 0 tensors) plus two more random MTP blocks model.mtp.layers.{1,2}.*, and a float64 reference
of the MTP heads (src/spec/mtp.h) computed by hand — transformers has no MTP module. The target's
final-normed hidden states come from transformers' MiMoV2FlashForCausalLM (mimo_native_f32: same
weights as mimo_hub_f32, native dialect) in float64.

Semantics (src/spec/mtp.h, vLLM's convention):
  head k (prefix model.mtp.layers.{k}.): z = eh_proj([enorm(embed(t)), hnorm(h)]); one pre-norm block
  (input_layernorm -> SWA attention with sinks, value scale, partial NeoX RoPE with swa_rope_theta,
  window sliding_window keys including self -> residual -> pre_mlp_layernorm -> SwiGLU -> residual);
  out = that residual stream; logits = lm_head(final_layernorm(out)).
  head 0 at position q: (h_q = target final-norm hidden, t_{q+1}) -> predicts t_{q+2}
  head k at position q >= k: (out^{k-1}_{q-1}, t_{q+1}) -> predicts t_{q+2}, RoPE position q,
  attending over head k's rows at positions k..q (window W).
  Draft chain at anchor position A = P + 1 (P = last position with a target hidden, tokens known
  through t_{P+1}): d0 = argmax head 0 at P; d_k = argmax head k at P + k, computed over the token
  sequence t_0..t_{P+1}, d0, ..., d_{k-1} with every head teacher-forced over it.

Sequence: S = prompt_ids + greedy_ids of mimo_hub_f32/reference.json (48 + 32 = 80 tokens); target
hiddens for positions 0..78 (one forward over S[:79]).

Writes $OUT/mimo_mtp_f32/{config.json, model.safetensors, reference_mtp.json, reference_mtp.safetensors}:
  reference_mtp.json: sequence_ids (S), chain_drafts[P] (3 drafts at every anchor, P = 0..78),
                      chain_margins[P] (top1 - top2 logit of each draft), notes, generator, checks
  reference_mtp.safetensors: head0_logits F32 [79, vocab] (head 0 at positions 0..78 on S),
                             target_final_norm F32 [79, hidden]

Usage: PYTHONUNBUFFERED=1 python3 scripts/gen_mtp_fixture.py --out $OUT
"""

import argparse
import json
import math
import os
import struct
import sys

import torch
import transformers
from transformers import MiMoV2FlashForCausalLM

GEN = f"transformers {transformers.__version__}, torch {torch.__version__}"
_DT2ST = {torch.float32: "F32", torch.float64: "F64", torch.bfloat16: "BF16", torch.int32: "I32", torch.int64: "I64"}
_ST2DT = {v: k for k, v in _DT2ST.items()}


def write_safetensors(path, tensors):
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        b = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": _DT2ST[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        buf = bytearray(data[a:b])
        out[name] = torch.frombuffer(buf, dtype=torch.uint8).view(_ST2DT[info["dtype"]]).reshape(info["shape"]).clone()
    return out


def mtp_block(hc, k, seed):
    """Random MTP block k, same recipe as scripts/gen_fixtures.py's mtp_tensors (block 0)."""
    g = torch.Generator().manual_seed(seed)
    H = hc["hidden_size"]
    nh, nkv = hc["swa_num_attention_heads"], hc["swa_num_key_value_heads"]
    hd, vd, inter = hc["swa_head_dim"], hc["swa_v_head_dim"], hc["intermediate_size"]
    shapes = {
        "enorm.weight": [H], "hnorm.weight": [H], "eh_proj.weight": [H, 2 * H],
        "input_layernorm.weight": [H],
        "self_attn.q_proj.weight": [nh * hd, H], "self_attn.k_proj.weight": [nkv * hd, H],
        "self_attn.v_proj.weight": [nkv * vd, H], "self_attn.o_proj.weight": [H, nh * vd],
        "self_attn.attention_sink_bias": [nh],
        "pre_mlp_layernorm.weight": [H],
        "mlp.gate_proj.weight": [inter, H], "mlp.up_proj.weight": [inter, H], "mlp.down_proj.weight": [H, inter],
        "final_layernorm.weight": [H],
    }
    out = {}
    for name in sorted(shapes):
        s = shapes[name]
        r = torch.randn(s, generator=g, dtype=torch.float64)
        v = 1 + 0.3 * r if "norm" in name else (r if len(s) == 1 else r / math.sqrt(s[-1]))
        out[f"model.mtp.layers.{k}.{name}"] = v.to(torch.float32)
    return out


class Mtp:
    """float64 MTP heads from hub-named tensors and the hub config."""

    def __init__(self, tensors, hc):
        self.w = {k: v.to(torch.float64) for k, v in tensors.items()}
        self.hc = hc
        self.H = hc["hidden_size"]
        self.nh, self.nkv = hc["swa_num_attention_heads"], hc["swa_num_key_value_heads"]
        self.hd, self.vd = hc["swa_head_dim"], hc["swa_v_head_dim"]
        self.rd = int(self.hd * hc["partial_rotary_factor"])
        self.theta = hc["swa_rope_theta"]
        self.window = hc["sliding_window"]
        self.eps = hc["layernorm_epsilon"]
        self.vscale = hc["attention_value_scale"]
        self.embed = self.w["model.embed_tokens.weight"]
        self.lm_head = self.w["lm_head.weight"]

    def rms(self, x, w):
        return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.eps))

    def rope(self, x, pos):  # x [n, heads, d]; NeoX pairing (j, j + rd/2) in the first rd dims
        rd = self.rd
        inv = self.theta ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)
        ang = pos.to(torch.float64)[:, None] * inv[None]
        c, s = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
        x1, x2, rest = x[..., : rd // 2], x[..., rd // 2: rd], x[..., rd:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)

    def head(self, k, hin, toks, pos):
        """Rows are consecutive positions pos[0].. of head k. Returns (out [n, H], logits [n, vocab])."""
        w = lambda name: self.w[f"model.mtp.layers.{k}.{name}"]  # noqa: E731
        n = hin.shape[0]
        e = self.embed[torch.tensor(toks, dtype=torch.long)]
        z = torch.cat([self.rms(e, w("enorm.weight")), self.rms(hin, w("hnorm.weight"))], dim=-1) @ w("eh_proj.weight").T
        a = self.rms(z, w("input_layernorm.weight"))
        q = (a @ w("self_attn.q_proj.weight").T).view(n, self.nh, self.hd)
        kk = (a @ w("self_attn.k_proj.weight").T).view(n, self.nkv, self.hd)
        v = (a @ w("self_attn.v_proj.weight").T).view(n, self.nkv, self.vd) * self.vscale
        p = torch.tensor(pos, dtype=torch.long)
        q, kk = self.rope(q, p), self.rope(kk, p)
        group = self.nh // self.nkv
        kk = kk.repeat_interleave(group, dim=1)  # kv head g serves query heads g*G .. g*G+G-1
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("ihd,jhd->hij", q, kk) * self.hd ** -0.5
        i = torch.arange(n)[:, None]
        j = torch.arange(n)[None, :]
        allowed = (j <= i) & (i - j < self.window)
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        sinks = w("self_attn.attention_sink_bias")[:, None, None].expand(self.nh, n, 1)
        probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
        o = torch.einsum("hij,jhd->ihd", probs, v).reshape(n, self.nh * self.vd)
        x = z + o @ w("self_attn.o_proj.weight").T
        m = self.rms(x, w("pre_mlp_layernorm.weight"))
        gate, up = m @ w("mlp.gate_proj.weight").T, m @ w("mlp.up_proj.weight").T
        x = x + (torch.nn.functional.silu(gate) * up) @ w("mlp.down_proj.weight").T
        logits = self.rms(x, w("final_layernorm.weight")) @ self.lm_head.T
        return x, logits

    def chain(self, hid, seq, P, n_heads):
        """Drafts at anchor P + 1: hid [>= P+1, H] target hiddens, seq tokens (>= P + 2)."""
        toks = list(seq[: P + 2])
        out, logits = self.head(0, hid[: P + 1], toks[1: P + 2], list(range(P + 1)))
        drafts, margins = [], []

        def pick(row):
            v, ix = torch.topk(row, 2)
            drafts.append(int(ix[0]))
            margins.append(float(v[0] - v[1]))

        pick(logits[P])
        prev = out  # rows of head k-1 at positions k-1 .. P + k - 1
        for k in range(1, n_heads):
            ext = toks + drafts  # t_0 .. t_{P+1}, d0 .. d_{k-1}
            pos = list(range(k, P + k + 1))
            out, logits = self.head(k, prev, [ext[q + 1] for q in pos], pos)
            pick(logits[-1])
            prev = out
        return drafts, margins


def rel_err(a, b):
    return float((a.to(torch.float64) - b.to(torch.float64)).abs().max() / b.to(torch.float64).abs().max())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--fixtures", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                                       "fixtures"))
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    src_hub = os.path.join(args.fixtures, "mimo_hub_f32")
    src_native = os.path.join(args.fixtures, "mimo_native_f32")
    hc = json.load(open(os.path.join(src_hub, "config.json")))
    ref = json.load(open(os.path.join(src_hub, "reference.json")))
    tensors = read_safetensors(os.path.join(src_hub, "model.safetensors"))
    for k in (1, 2):
        tensors.update(mtp_block(hc, k, 4321 + 1000 * k))
    n_heads = 3

    dst = os.path.join(args.out, "mimo_mtp_f32")
    os.makedirs(dst, exist_ok=True)
    json.dump(hc, open(os.path.join(dst, "config.json"), "w"), indent=2)
    write_safetensors(os.path.join(dst, "model.safetensors"), tensors)

    # Target final-norm hiddens from transformers (float64, eager).
    model = MiMoV2FlashForCausalLM.from_pretrained(src_native, dtype=torch.float64, attn_implementation="eager")
    for fn in ("set_attn_implementation", "set_experts_implementation"):
        if hasattr(model, fn):
            try:
                getattr(model, fn)("eager")
            except Exception as e:  # noqa: BLE001
                print(f"note: {fn} failed: {e}")
    model.eval()
    seq = ref["prompt_ids"] + ref["greedy_ids"]
    n_pos = len(seq) - 1
    ids = torch.tensor([seq[:n_pos]], dtype=torch.long)
    hid = model.model(input_ids=ids, use_cache=False).last_hidden_state[0]  # [n_pos, H], after model.norm
    checks = {}
    ref_hidden = read_safetensors(os.path.join(src_hub, "reference_hidden.safetensors"))["final_norm"]
    checks["final_norm_vs_reference_hidden"] = rel_err(hid[: ref_hidden.shape[0]], ref_hidden)
    logits_t = hid @ model.lm_head.weight.T
    ref_logits = read_safetensors(os.path.join(src_hub, "reference.safetensors"))["logits"]
    checks["target_logits_vs_reference"] = rel_err(logits_t[: ref_logits.shape[0]], ref_logits)
    # The greedy continuation is the target's argmax: the hiddens really are the lm_head's input.
    checks["greedy_consistent"] = all(int(logits_t[p].argmax()) == seq[p + 1] for p in range(len(ref["prompt_ids"]) - 1, n_pos))
    print("checks:", checks)
    assert checks["final_norm_vs_reference_hidden"] < 1e-5, checks
    assert checks["target_logits_vs_reference"] < 1e-5, checks

    mtp = Mtp(tensors, hc)
    out0, head0_logits = mtp.head(0, hid, seq[1: n_pos + 1], list(range(n_pos)))
    chains, margins = [], []
    for P in range(n_pos):
        d, m = mtp.chain(hid, seq, P, n_heads)
        chains.append(d)
        margins.append([round(x, 6) for x in m])
    # Self-check: the chain's head 0 equals the one-shot head 0 (causal, so prefixes agree).
    checks["chain_head0_consistent"] = all(chains[P][0] == int(head0_logits[P].argmax()) for P in range(n_pos))
    min_margin = min(min(m) for m in margins)
    checks["min_draft_margin"] = min_margin
    print("checks:", checks)
    print("drafts at the last anchor:", chains[-1], margins[-1])

    write_safetensors(os.path.join(dst, "reference_mtp.safetensors"), {
        "head0_logits": head0_logits.to(torch.float32),
        "target_final_norm": hid.to(torch.float32),
    })
    json.dump({
        "sequence_ids": seq,
        "n_positions": n_pos,
        "chain_drafts": chains,
        "chain_margins": margins,
        "generator": GEN,
        "checks": checks,
        "notes": ("mimo_hub_f32 + random MTP blocks 1, 2 (seeds 5321, 6321; block 0 unchanged). Target hiddens: "
                  "transformers MiMoV2FlashForCausalLM (mimo_native_f32) float64 model.model(...).last_hidden_state "
                  "over sequence_ids[:n_positions]. MTP heads by hand in float64 (scripts/gen_mtp_fixture.py, "
                  "semantics of src/spec/mtp.h). head0_logits[q] = head 0 on (h_q, t_{q+1}); chain_drafts[P] = "
                  "drafts d0, d1, d2 at anchor position P + 1."),
    }, open(os.path.join(dst, "reference_mtp.json"), "w"), indent=1)
    print("wrote", dst, sorted(os.listdir(dst)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
