#!/usr/bin/env python3
"""Generate the tiny golden fixtures under tests/fixtures/ (run on the GPU machine, CPU is enough).

Each fixture directory is a Hugging Face checkpoint plus a float64 reference:

  config.json, model.safetensors | model-0000k-of-0000n.safetensors + model.safetensors.index.json
  reference.json         {"prompt_ids", "greedy_ids" (32), "greedy_margins", "generator", "notes"}
  reference.safetensors  "logits": F32 [len(prompt_ids), vocab_size], logits at every prompt position
  reference_hidden.safetensors  (debug aid) "embed", "layer.{L}" (decoder layer outputs), "final_norm",
                                 each F32 [len(prompt_ids), hidden_size]

References are computed with transformers in float64, eager attention, eager experts; greedy decoding
recomputes the whole sequence every step (use_cache=False).

Fixtures:
  mimo_native_f32  MiMoV2FlashForCausalLM from a native MiMoV2FlashConfig, save_pretrained (f32).
  mimo_hub_f32     the same weights/reference in the hub (remote-code) dialect + random MTP tensors.
  mimo_hub_fp8     hub dialect, FP8 e4m3 128x128 block-quantised, 2 shards; reference = f64 model whose
                   weights are exactly the dequantised values.
  qwen3_f32        Qwen3ForCausalLM, tied embeddings.
  qwen3_moe_f32    Qwen3MoeForCausalLM.

Usage: PYTHONUNBUFFERED=1 python3 scripts/gen_fixtures.py --out $OUT
Writes $OUT/fixtures.tar (the fixture directories), $OUT/summary.json, and $OUT/src.tar (the transformers
sources the fixtures depend on, for reading).
"""

import argparse
import copy
import json
import math
import os
import shutil
import struct
import sys
import tarfile
import tempfile
import traceback

import torch

import transformers

GEN = f"transformers {transformers.__version__}, torch {torch.__version__}"
N_GREEDY = 32
MIN_MARGIN = 0.05
MIN_ROUTER_GAP = 1e-4
SUMMARY = {"generator": GEN, "fixtures": {}, "errors": []}

# ----------------------------------------------------------------------------------------------
# safetensors by hand (the format: u64 LE header length, JSON header, raw little-endian data)
# ----------------------------------------------------------------------------------------------
_DT2ST = {
    torch.float32: "F32",
    torch.float64: "F64",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
}
_ST2DT = {v: k for k, v in _DT2ST.items()}


def write_safetensors(path, tensors, metadata=None):
    """tensors: dict name -> torch tensor (CPU). Data laid out in name order."""
    header = {}
    blobs = []
    off = 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        b = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _DT2ST[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header["__metadata__"] = dict(metadata or {"format": "pt"})
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    return off


def read_safetensors_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


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
        dt = _ST2DT[info["dtype"]]
        buf = bytearray(data[a:b])
        t = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
        out[name] = t.view(dt).reshape(info["shape"]).clone()
    return out


def read_checkpoint(d):
    idx = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(idx):
        wm = json.load(open(idx))["weight_map"]
        out = {}
        for fn in sorted(set(wm.values())):
            out.update(read_safetensors(os.path.join(d, fn)))
        assert set(out) == set(wm), "index weight_map does not match shard contents"
        return out
    return read_safetensors(os.path.join(d, "model.safetensors"))


def describe_checkpoint(d):
    """name -> [dtype, shape, file] for every tensor of a checkpoint dir."""
    res = {}
    for fn in sorted(os.listdir(d)):
        if fn.endswith(".safetensors") and not fn.startswith("reference"):
            for name, info in read_safetensors_header(os.path.join(d, fn)).items():
                if name != "__metadata__":
                    res[name] = [info["dtype"], info["shape"], fn]
    return res


# ----------------------------------------------------------------------------------------------
# model helpers
# ----------------------------------------------------------------------------------------------
def set_eager(model):
    for fn, arg in (("set_attn_implementation", "eager"), ("set_experts_implementation", "eager")):
        if hasattr(model, fn):
            try:
                getattr(model, fn)(arg)
            except Exception as e:  # noqa: BLE001
                print(f"  note: {fn}({arg!r}) failed: {e}")
    return model


def build_model(cls, cfg):
    for attr in ("_attn_implementation", "_experts_implementation"):
        try:
            setattr(cfg, attr, "eager")
        except Exception:  # noqa: BLE001
            pass
    torch.manual_seed(0)
    model = cls(cfg)
    set_eager(model)
    model.eval()
    return model


def randomize(model, seed, hidden, qk_gain=1.4):
    """Replace EVERY state-dict entry with seeded random values (f32). Tied tensors are drawn once.
    qk_gain scales q_proj/k_proj (> 1: sharper attention than a 1/sqrt(fan_in) init)."""
    g = torch.Generator().manual_seed(seed)
    sd = model.state_dict()
    new = {}
    by_ptr = {}
    for name in sorted(sd):
        t = sd[name]
        ptr = t.data_ptr()
        if ptr in by_ptr:
            new[name] = by_ptr[ptr]
            continue
        shape = tuple(t.shape)
        rn = torch.randn(shape, generator=g, dtype=torch.float64)
        if "norm" in name:  # input/post/final RMSNorm, q_norm/k_norm
            v = 1.0 + 0.3 * rn
        elif name.endswith("sinks") or name.endswith("attention_sink_bias"):
            v = rn
        elif name.endswith("e_score_correction_bias"):
            v = 0.5 * rn
        elif "embed_tokens" in name:
            v = rn * (3.0 / math.sqrt(hidden))  # also the lm_head when tied
        elif name.startswith("lm_head"):
            v = rn * (3.0 / math.sqrt(hidden))  # logits spread of ~3 units
        elif name.endswith("mlp.gate.weight"):
            v = rn * (1.0 / math.sqrt(hidden))
        elif "q_proj" in name or "k_proj" in name:
            v = rn * (qk_gain / math.sqrt(shape[-1]))  # sharper attention
        elif len(shape) >= 2:
            v = rn * (1.0 / math.sqrt(shape[-1]))
        else:
            print(f"  WARNING randomize: no rule for {name} {shape}, using 0.1*randn")
            v = 0.1 * rn
        v = v.to(torch.float32)
        by_ptr[ptr] = v
        new[name] = v
    model.load_state_dict(new, strict=True)
    return model


class Taps:
    """Forward hooks: decoder layer outputs, final norm, and router inputs."""

    def __init__(self, model):
        self.handles = []
        self.layers = {}
        self.router_in = {}
        self.embed = None
        self.final = None
        base = model.model
        for i, layer in enumerate(base.layers):
            self.handles.append(layer.register_forward_hook(self._layer_hook(i)))
            mlp = getattr(layer, "mlp", None)
            gate = getattr(mlp, "gate", None)
            if hasattr(mlp, "experts") and hasattr(gate, "weight"):
                self.handles.append(gate.register_forward_pre_hook(self._router_hook(i)))
        self.handles.append(base.embed_tokens.register_forward_hook(self._set("embed")))
        self.handles.append(base.norm.register_forward_hook(self._set("final")))

    def _layer_hook(self, i):
        def f(mod, inp, out):
            o = out[0] if isinstance(out, (tuple, list)) else out
            self.layers[i] = o.detach()
        return f

    def _router_hook(self, i):
        def f(mod, inp):
            self.router_in[i] = (inp[0].detach(), mod)
        return f

    def _set(self, key):
        def f(mod, inp, out):
            setattr(self, key, out.detach())
        return f

    def remove(self):
        for h in self.handles:
            h.remove()


def router_gaps(taps, cfg_kind, cfg):
    """Smallest selection gap over all MoE layers and tokens (how far the routing is from a tie)."""
    gmin = float("inf")
    for i, (x, mod) in taps.router_in.items():
        x = x.reshape(-1, x.shape[-1]).to(torch.float64)
        r = x @ mod.weight.to(torch.float64).T
        k = cfg["top_k"]
        if cfg_kind == "mimo":
            s = torch.sigmoid(r)
            c = s + mod.e_score_correction_bias.to(torch.float64)
            E = c.shape[-1]
            G, TG = cfg["n_group"], cfg["topk_group"]
            if G > 1:
                gs = c.view(-1, G, E // G).topk(2, dim=-1).values.sum(-1)
                gsort = gs.sort(dim=-1, descending=True).values
                gmin = min(gmin, float((gsort[:, TG - 1] - gsort[:, TG]).min()))
                gidx = gs.topk(TG, dim=-1).indices
                gmask = torch.zeros_like(gs).scatter_(1, gidx, 1.0).bool()
                emask = gmask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
                c = c.masked_fill(~emask, float("-inf"))
            cs = c.sort(dim=-1, descending=True).values
            gap = cs[:, k - 1] - cs[:, k]
        else:
            cs = r.sort(dim=-1, descending=True).values
            gap = cs[:, k - 1] - cs[:, k]
        gmin = min(gmin, float(gap.min()))
    return gmin


@torch.no_grad()
def forward_logits(model, ids):
    return model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False).logits[0]


@torch.no_grad()
def greedy(model, prompt, n=N_GREEDY):
    seq = list(prompt)
    ids, margins = [], []
    for _ in range(n):
        last = forward_logits(model, seq)[-1]
        v, ix = torch.topk(last, 2)
        ids.append(int(ix[0]))
        margins.append(float(v[0] - v[1]))
        seq.append(ids[-1])
    return ids, margins


@torch.no_grad()
def choose_prompt(model, vocab, plen, kind, rcfg, seed0, tries=120, min_router_gap=MIN_ROUTER_GAP):
    """Find a prompt whose greedy continuation has no near-ties (logits and routing) and does not collapse
    into a short cycle. Takes the first prompt meeting the strong criteria, else the best one seen."""
    best = None
    for t in range(tries):
        g = torch.Generator().manual_seed(seed0 + t)
        prompt = torch.randint(3, vocab, (plen,), generator=g).tolist()
        ids, margins = greedy(model, prompt)
        gap = float("inf")
        if rcfg is not None:
            taps = Taps(model)
            forward_logits(model, prompt + ids)
            gap = router_gaps(taps, kind, rcfg)
            taps.remove()
        ok24 = min(margins[:24]) >= MIN_MARGIN
        ok32 = min(margins) >= MIN_MARGIN
        okr = gap >= min_router_gap
        strong = min(margins) >= 2 * MIN_MARGIN and gap >= 10 * min_router_gap and len(set(ids)) >= 8
        score = (ok24, ok32 and okr, strong, okr, ok32, min(len(set(ids)), 8), min(gap, 100 * min_router_gap),
                 min(margins))
        if best is None or score > best[0]:
            best = (score, seed0 + t, prompt, ids, margins, gap)
        if strong:
            break
    score, seed, prompt, ids, margins, gap = best
    print(f"  prompt seed {seed}: min margin first24 {min(margins[:24]):.4f}, all32 {min(margins):.4f}, "
          f"router gap {gap:.3g}, distinct greedy ids {len(set(ids))}, strong {score[2]}")
    if not score[0]:
        SUMMARY["errors"].append(f"{kind}: no prompt with 24 greedy steps of margin >= {MIN_MARGIN}")
    if rcfg is not None and not score[3]:
        SUMMARY["errors"].append(f"{kind}: no prompt with MoE selection gaps >= {min_router_gap} (best {gap:.3g})")
    return seed, prompt, ids, margins, gap


@torch.no_grad()
def reference(model, prompt):
    taps = Taps(model)
    logits = forward_logits(model, prompt)
    hid = {"embed": taps.embed[0].float(), "final_norm": taps.final[0].float()}
    for i, h in taps.layers.items():
        hid[f"layer.{i}"] = h[0].float()
    taps.remove()
    return logits, hid


def rel_err(a, b):
    a = a.to(torch.float64)
    b = b.to(torch.float64)
    return float((a - b).abs().max() / b.abs().max())


def write_reference(d, prompt, ids, margins, logits, hid, notes, extra=None):
    ref = {
        "prompt_ids": prompt,
        "greedy_ids": ids,
        "greedy_margins": [round(m, 6) for m in margins],
        "generator": GEN,
        "notes": notes,
    }
    if extra:
        ref.update(extra)
    with open(os.path.join(d, "reference.json"), "w") as f:
        f.write("{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in ref.items()) + "\n}\n")
    write_safetensors(os.path.join(d, "reference.safetensors"), {"logits": logits.to(torch.float32)})
    write_safetensors(os.path.join(d, "reference_hidden.safetensors"), {k: v.contiguous() for k, v in hid.items()})


# ----------------------------------------------------------------------------------------------
# MiMo: native <-> hub tensor names, hub config, manual forward, FP8 quantisation
# ----------------------------------------------------------------------------------------------
def native_to_hub(sd, H, I):
    out = {}
    for n, t in sd.items():
        if n.endswith("self_attn.sinks"):
            out[n[: -len("sinks")] + "attention_sink_bias"] = t
        elif n.endswith("mlp.experts.gate_up_proj"):
            p = n[: -len("gate_up_proj")]
            E, A, B = t.shape
            if (A, B) == (2 * I, H):
                gate, up = t[:, :I, :], t[:, I:, :]
            elif (A, B) == (H, 2 * I):
                gate, up = t[:, :, :I].transpose(1, 2), t[:, :, I:].transpose(1, 2)
            else:
                raise RuntimeError(f"unexpected gate_up_proj shape {tuple(t.shape)}")
            for e in range(E):
                out[f"{p}{e}.gate_proj.weight"] = gate[e].contiguous()
                out[f"{p}{e}.up_proj.weight"] = up[e].contiguous()
        elif n.endswith("mlp.experts.down_proj"):
            p = n[: -len("down_proj")]
            E, A, B = t.shape
            if (A, B) == (H, I):
                d = t
            elif (A, B) == (I, H):
                d = t.transpose(1, 2)
            else:
                raise RuntimeError(f"unexpected down_proj shape {tuple(t.shape)}")
            for e in range(E):
                out[f"{p}{e}.down_proj.weight"] = d[e].contiguous()
        else:
            out[n] = t
    return out


def hub_to_native(hub, native_shapes, H, I, E):
    """Inverse of native_to_hub, following the native model's actual parameter layout."""
    out = {}
    for n, shape in native_shapes.items():
        if n.endswith("self_attn.sinks"):
            out[n] = hub[n[: -len("sinks")] + "attention_sink_bias"]
        elif n.endswith("mlp.experts.gate_up_proj"):
            p = n[: -len("gate_up_proj")]
            g = torch.stack([hub[f"{p}{e}.gate_proj.weight"] for e in range(E)])
            u = torch.stack([hub[f"{p}{e}.up_proj.weight"] for e in range(E)])
            t = torch.cat([g, u], dim=1)  # [E, 2I, H]
            out[n] = t if tuple(shape) == tuple(t.shape) else t.transpose(1, 2).contiguous()
        elif n.endswith("mlp.experts.down_proj"):
            p = n[: -len("down_proj")]
            t = torch.stack([hub[f"{p}{e}.down_proj.weight"] for e in range(E)])  # [E, H, I]
            out[n] = t if tuple(shape) == tuple(t.shape) else t.transpose(1, 2).contiguous()
        else:
            out[n] = hub[n]
        assert tuple(out[n].shape) == tuple(shape), (n, tuple(out[n].shape), tuple(shape))
    return out


def hub_config(p, torch_dtype, quant=None):
    n = p["num_hidden_layers"]
    cfg = {
        "architectures": ["MiMoV2FlashForCausalLM"],
        "model_type": "mimo_v2_flash",
        "auto_map": {
            "AutoConfig": "configuration_mimo_v2_flash.MiMoV2FlashConfig",
            "AutoModel": "modeling_mimo_v2_flash.MiMoV2FlashModel",
            "AutoModelForCausalLM": "modeling_mimo_v2_flash.MiMoV2FlashForCausalLM",
        },
        "vocab_size": p["vocab_size"],
        "hidden_size": p["hidden_size"],
        "intermediate_size": p["intermediate_size"],
        "moe_intermediate_size": p["moe_intermediate_size"],
        "num_hidden_layers": n,
        "num_attention_heads": p["num_attention_heads"],
        "num_key_value_heads": p["num_key_value_heads"],
        "head_dim": p["head_dim"],
        "v_head_dim": p["v_head_dim"],
        "swa_num_attention_heads": p["num_attention_heads"],
        "swa_num_key_value_heads": 2 * p["num_key_value_heads"],
        "swa_head_dim": p["head_dim"],
        "swa_v_head_dim": p["v_head_dim"],
        "hybrid_block_size": None,
        "hybrid_layer_pattern": [1 if t == "sliding_attention" else 0 for t in p["layer_types"]],
        "moe_layer_freq": [1 if t == "sparse" else 0 for t in p["mlp_layer_types"]],
        "sliding_window": p["sliding_window"],
        "sliding_window_size": p["sliding_window"],
        "attention_chunk_size": p["sliding_window"],
        "rope_theta": p["rope_theta_full"],
        "swa_rope_theta": p["rope_theta_swa"],
        "partial_rotary_factor": p["partial_rotary_factor"],
        "rope_scaling": None,
        "max_position_embeddings": p["max_position_embeddings"],
        "layernorm_epsilon": p["rms_norm_eps"],
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "add_swa_attention_sink_bias": True,
        "add_full_attention_sink_bias": False,
        "attention_value_scale": p["attention_value_scale"],
        "n_routed_experts": p["n_routed_experts"],
        "n_shared_experts": None,
        "num_experts_per_tok": p["num_experts_per_tok"],
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "n_group": p["n_group"],
        "topk_group": p["topk_group"],
        "norm_topk_prob": True,
        "routed_scaling_factor": p["hub_routed_scaling_factor"],
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": torch_dtype,
        "transformers_version": transformers.__version__,
    }
    if quant is not None:
        cfg["quantization_config"] = quant
    return cfg


def native_config(p):
    from transformers import MiMoV2FlashConfig

    return MiMoV2FlashConfig(
        vocab_size=p["vocab_size"],
        hidden_size=p["hidden_size"],
        intermediate_size=p["intermediate_size"],
        num_hidden_layers=p["num_hidden_layers"],
        num_attention_heads=p["num_attention_heads"],
        num_key_value_heads=p["num_key_value_heads"],
        head_dim=p["head_dim"],
        v_head_dim=p["v_head_dim"],
        hidden_act="silu",
        max_position_embeddings=p["max_position_embeddings"],
        rms_norm_eps=p["rms_norm_eps"],
        tie_word_embeddings=False,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": p["rope_theta_full"],
                               "partial_rotary_factor": p["partial_rotary_factor"]},
            "sliding_attention": {"rope_type": "default", "rope_theta": p["rope_theta_swa"],
                                  "partial_rotary_factor": p["partial_rotary_factor"]},
        },
        attention_bias=False,
        moe_intermediate_size=p["moe_intermediate_size"],
        num_experts_per_tok=p["num_experts_per_tok"],
        n_routed_experts=p["n_routed_experts"],
        routed_scaling_factor=p["routed_scaling_factor"],
        n_group=p["n_group"],
        topk_group=p["topk_group"],
        norm_topk_prob=True,
        sliding_window=p["sliding_window"],
        layer_types=p["layer_types"],
        mlp_layer_types=p["mlp_layer_types"],
        attention_value_scale=p["attention_value_scale"],
        bos_token_id=1,
        eos_token_id=2,
    )


def mtp_tensors(hc, seed, dtype):
    """Random MTP block 0 (research 6.3), scaled to the tiny dims; loaders must recognise and skip it."""
    g = torch.Generator().manual_seed(seed)
    H = hc["hidden_size"]
    nh, nkv = hc["swa_num_attention_heads"], hc["swa_num_key_value_heads"]
    hd, vd, inter = hc["swa_head_dim"], hc["swa_v_head_dim"], hc["intermediate_size"]
    p = "model.mtp.layers.0."
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
    for k in sorted(shapes):
        s = shapes[k]
        r = torch.randn(s, generator=g, dtype=torch.float64)
        if "norm" in k:
            v = 1 + 0.3 * r
        elif len(s) == 1:
            v = r
        else:
            v = r / math.sqrt(s[-1])
        out[p + k] = v.to(dtype)
    return out


def mimo_manual_forward(hub, hc, ids, window_offset=0):
    """Independent float64 forward from hub-named tensors and the hub config (semantics cross-check)."""
    f64 = {k: v.to(torch.float64) for k, v in hub.items() if not k.startswith("model.mtp.")}
    H = hc["hidden_size"]
    eps = hc["layernorm_epsilon"]
    T = len(ids)
    pos = torch.arange(T, dtype=torch.float64)

    def rms(x, w):
        return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))

    def rope(x, rd, theta):  # x [T, h, d]; NeoX pairing (j, j + rd/2) within the first rd dims
        inv = theta ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)
        ang = pos[:, None] * inv[None]
        c, s = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
        x1, x2, rest = x[..., : rd // 2], x[..., rd // 2: rd], x[..., rd:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)

    x = f64["model.embed_tokens.weight"][ids]
    for L in range(hc["num_hidden_layers"]):
        p = f"model.layers.{L}."
        swa = hc["hybrid_layer_pattern"][L] == 1
        nh = hc["swa_num_attention_heads"] if swa else hc["num_attention_heads"]
        nkv = hc["swa_num_key_value_heads"] if swa else hc["num_key_value_heads"]
        hd = hc["swa_head_dim"] if swa else hc["head_dim"]
        vd = hc["swa_v_head_dim"] if swa else hc["v_head_dim"]
        theta = hc["swa_rope_theta"] if swa else hc["rope_theta"]
        rd = int(hd * hc["partial_rotary_factor"])
        a = rms(x, f64[p + "input_layernorm.weight"])
        q = (a @ f64[p + "self_attn.q_proj.weight"].T).view(T, nh, hd)
        k = (a @ f64[p + "self_attn.k_proj.weight"].T).view(T, nkv, hd)
        v = (a @ f64[p + "self_attn.v_proj.weight"].T).view(T, nkv, vd) * hc["attention_value_scale"]
        q, k = rope(q, rd, theta), rope(k, rd, theta)
        grp = nh // nkv
        kk = k.repeat_interleave(grp, dim=1)
        vv = v.repeat_interleave(grp, dim=1)
        s = torch.einsum("ihd,jhd->hij", q, kk) * hd ** -0.5
        i_ = torch.arange(T)[:, None]
        j_ = torch.arange(T)[None, :]
        allowed = j_ <= i_
        if swa:
            allowed = allowed & (i_ - j_ < hc["sliding_window"] + window_offset)
        s = s.masked_fill(~allowed[None], float("-inf"))
        sink_name = p + "self_attn.attention_sink_bias"
        if sink_name in f64:
            sink = f64[sink_name][:, None, None].expand(nh, T, 1)
            s = torch.cat([s, sink], dim=-1)
        pr = torch.softmax(s, dim=-1)[..., :T]
        o = torch.einsum("hij,jhd->ihd", pr, vv).reshape(T, nh * vd)
        x = x + o @ f64[p + "self_attn.o_proj.weight"].T
        m = rms(x, f64[p + "post_attention_layernorm.weight"])
        if hc["moe_layer_freq"][L] == 0:
            gt = m @ f64[p + "mlp.gate_proj.weight"].T
            up = m @ f64[p + "mlp.up_proj.weight"].T
            x = x + (torch.nn.functional.silu(gt) * up) @ f64[p + "mlp.down_proj.weight"].T
        else:
            E, K = hc["n_routed_experts"], hc["num_experts_per_tok"]
            G, TG = hc["n_group"], hc["topk_group"]
            sc = torch.sigmoid(m @ f64[p + "mlp.gate.weight"].T)
            c = sc + f64[p + "mlp.gate.e_score_correction_bias"]
            if G > 1:
                gs = c.view(T, G, E // G).topk(2, dim=-1).values.sum(-1)
                gidx = gs.topk(TG, dim=-1).indices
                gm = torch.zeros_like(gs).scatter_(1, gidx, 1.0).bool()
                c = c.masked_fill(~gm.unsqueeze(-1).expand(T, G, E // G).reshape(T, E), float("-inf"))
            idx = c.topk(K, dim=-1).indices
            w = sc.gather(1, idx)
            if hc["norm_topk_prob"]:
                w = w / (w.sum(-1, keepdim=True) + 1e-20)
            w = w * (hc["routed_scaling_factor"] if hc["routed_scaling_factor"] is not None else 1.0)
            out = torch.zeros_like(x)
            for t in range(T):
                for j in range(K):
                    e = int(idx[t, j])
                    q_ = f"{p}mlp.experts.{e}."
                    h_ = torch.nn.functional.silu(f64[q_ + "gate_proj.weight"] @ m[t]) * (f64[q_ + "up_proj.weight"] @ m[t])
                    out[t] += w[t, j] * (f64[q_ + "down_proj.weight"] @ h_)
            x = x + out
    x = rms(x, f64["model.norm.weight"])
    return x @ f64["lm_head.weight"].T


FP8_MAX = 448.0


def quantize_block(w, block=128):
    """w [R, C] float -> (fp8 [R, C], scale_inv f32 [ceil(R/128), ceil(C/128)]); W ~= fp8 * scale_inv."""
    R, C = w.shape
    w = w.to(torch.float32)
    nr, nc = -(-R // block), -(-C // block)
    scale = torch.empty(nr, nc, dtype=torch.float32)
    scaled = torch.empty(R, C, dtype=torch.float32)
    for i in range(nr):
        for j in range(nc):
            blk = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            amax = float(blk.abs().max())
            s = torch.tensor(amax / FP8_MAX if amax > 0 else 1.0, dtype=torch.float32)
            scale[i, j] = s
            scaled[i * block:(i + 1) * block, j * block:(j + 1) * block] = blk / s
    q = scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quantize_sharded(w, shards):
    """Per-shard quantisation: the 128-row grid restarts at every shard boundary (rows/shards rows each)."""
    R = w.shape[0]
    assert R % shards == 0
    qs, ss = zip(*[quantize_block(c) for c in w.split(R // shards, dim=0)])
    return torch.cat(qs, 0), torch.cat(ss, 0)


def dequantize(q, s, block=128):
    """Loader rule of research 6.4: contiguous grid if rows match, else find the shard count."""
    R, C = q.shape
    nr = s.shape[0]
    if nr == -(-R // block):
        shards = 1
    else:
        cands = [S for S in range(1, R + 1) if R % S == 0 and S * -(-(R // S) // block) == nr]
        assert len(cands) >= 1, (tuple(q.shape), tuple(s.shape))
        shards = cands[0]
    out = []
    for ci, chunk in enumerate(q.split(R // shards, dim=0)):
        r = chunk.shape[0]
        nrc = -(-r // block)
        sc = s[ci * nrc:(ci + 1) * nrc].to(torch.float64)
        full = sc.repeat_interleave(block, 0)[:r].repeat_interleave(block, 1)[:, :C]
        out.append(chunk.to(torch.float64) * full)
    return torch.cat(out, 0)


# ----------------------------------------------------------------------------------------------
# fixtures
# ----------------------------------------------------------------------------------------------
MIMO_NATIVE = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=1, head_dim=24, v_head_dim=16,
    max_position_embeddings=4096, rms_norm_eps=1e-5,
    rope_theta_full=1_000_000.0, rope_theta_swa=20_000.0, partial_rotary_factor=0.334,
    moe_intermediate_size=40, num_experts_per_tok=2, n_routed_experts=8,
    routed_scaling_factor=1.5, hub_routed_scaling_factor=1.5, n_group=2, topk_group=1,
    sliding_window=8, attention_value_scale=0.707,
    layer_types=["full_attention", "sliding_attention", "sliding_attention",
                 "full_attention", "sliding_attention", "sliding_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse", "dense", "sparse"],
)

MIMO_FP8 = dict(
    vocab_size=512, hidden_size=320, intermediate_size=200, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=4, head_dim=48, v_head_dim=32,
    max_position_embeddings=4096, rms_norm_eps=1e-5,
    rope_theta_full=5_000_000.0, rope_theta_swa=10_000.0, partial_rotary_factor=0.334,
    moe_intermediate_size=96, num_experts_per_tok=2, n_routed_experts=8,
    routed_scaling_factor=1.0, hub_routed_scaling_factor=None, n_group=1, topk_group=1,
    sliding_window=8, attention_value_scale=0.707,
    layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
)


def mimo_rcfg(p):
    return {"top_k": p["num_experts_per_tok"], "n_group": p["n_group"], "topk_group": p["topk_group"]}


def check_manual(tag, hub, hc, prompt, ref_logits):
    res = {}
    for off in (0, 1, -1):
        man = mimo_manual_forward(hub, hc, prompt, window_offset=off)
        res[off] = rel_err(man, ref_logits)
        if off == 0 and res[0] < 1e-5:
            break
    print(f"  manual forward vs transformers ({tag}): rel err by window offset {res}")
    if res[0] >= 1e-4:
        SUMMARY["errors"].append(f"{tag}: manual forward mismatch {res}")
    return res


def gen_mimo_native_and_hub(root):
    from transformers import MiMoV2FlashForCausalLM

    p = MIMO_NATIVE
    H, I, E = p["hidden_size"], p["moe_intermediate_size"], p["n_routed_experts"]
    cfg = native_config(p)
    model = build_model(MiMoV2FlashForCausalLM, cfg)
    randomize(model, 1234, H)
    print("  in-memory state dict:")
    for n, t in model.state_dict().items():
        if ".layers.0." in n or ".layers.1." in n or "layers" not in n:
            print(f"    {n} {list(t.shape)} {t.dtype}")

    # native: save_pretrained in f32
    d = os.path.join(root, "mimo_native_f32")
    model.save_pretrained(d, safe_serialization=True)
    native_desc = describe_checkpoint(d)
    sd32 = {k: v.clone() for k, v in model.state_dict().items()}
    native_shapes = {k: tuple(v.shape) for k, v in sd32.items()}

    m64 = copy.deepcopy(model).double()
    set_eager(m64)
    seed, prompt, ids, margins, gap = choose_prompt(m64, p["vocab_size"], 48, "mimo", mimo_rcfg(p), 100)
    logits, hid = reference(m64, prompt)
    print(f"  logits std {float(logits.std()):.3f}, margins min/median {min(margins):.3f}/"
          f"{sorted(margins)[len(margins) // 2]:.3f}")
    notes = ("MiMoV2FlashForCausalLM built from a transformers-native MiMoV2FlashConfig, random f32 weights "
             "(seed 1234), saved with save_pretrained; reference in float64 (model.double(), eager attention, "
             f"eager experts), greedy by full recompute. Prompt seed {seed}. Minimum MoE selection gap over "
             f"prompt+greedy tokens: {gap:.3g}. Layers: attention {p['layer_types']}, mlp {p['mlp_layer_types']}; "
             "SWA layers have 2x the full-attention KV heads (hard-coded by the native class) and sinks.")
    per_expert = any(".mlp.experts.0.gate_proj.weight" in n for n in native_desc)
    sink_name = "attention_sink_bias" if any(n.endswith("attention_sink_bias") for n in native_desc) else "sinks"
    native_notes = notes + (f" On disk (as written by save_pretrained): experts "
                            f"{'per expert (mlp.experts.E.{gate,up,down}_proj.weight)' if per_expert else 'stacked'}"
                            f", sinks named self_attn.{sink_name}; in memory transformers holds stacked "
                            "mlp.experts.gate_up_proj [E, 2*moe_inter, hidden] ([gate; up] along dim 1), "
                            "mlp.experts.down_proj [E, hidden, moe_inter] and self_attn.sinks.")
    write_reference(d, prompt, ids, margins, logits, hid, native_notes)

    # hub dialect, same weights
    hub = native_to_hub(sd32, H, I)
    back = hub_to_native(hub, native_shapes, H, I, E)
    for k in sd32:
        assert torch.equal(back[k], sd32[k]), k
    hc = hub_config(p, "float32")
    hub_all = dict(hub)
    hub_all.update(mtp_tensors(hc, 4321, torch.float32))
    dh = os.path.join(root, "mimo_hub_f32")
    os.makedirs(dh, exist_ok=True)
    json.dump(hc, open(os.path.join(dh, "config.json"), "w"), indent=2)
    write_safetensors(os.path.join(dh, "model.safetensors"), hub_all)
    notes_h = notes.replace("saved with save_pretrained", "written in the hub (remote-code) dialect by "
                            "scripts/gen_fixtures.py (per-expert tensors, attention_sink_bias, random MTP "
                            "block model.mtp.layers.0.* that loaders must skip)")
    write_reference(dh, prompt, ids, margins, logits, hid,
                    "Same weights and reference as mimo_native_f32. " + notes_h)

    checks = {}
    # self-check 1: reload the native dir with transformers
    try:
        r = MiMoV2FlashForCausalLM.from_pretrained(d, dtype=torch.float64, attn_implementation="eager")
        set_eager(r).eval()
        checks["native_reload_rel_err"] = rel_err(forward_logits(r, prompt), logits)
        print(f"  native reload rel err {checks['native_reload_rel_err']:.3g}")
        if checks["native_reload_rel_err"] > 1e-6:
            SUMMARY["errors"].append(f"mimo_native_f32 reload mismatch {checks['native_reload_rel_err']}")
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        SUMMARY["errors"].append(f"mimo_native_f32 reload failed: {e!r}")
    # self-check 2: manual forward from the hub files as written
    hub_read = read_checkpoint(dh)
    checks["manual_vs_ref"] = check_manual("mimo_hub_f32", hub_read, hc, prompt, logits)
    # self-check 3: the hub dir's tensors (MTP included) loaded by transformers under the native config
    try:
        tmp = tempfile.mkdtemp()
        cfg.save_pretrained(tmp)
        shutil.copy(os.path.join(dh, "model.safetensors"), tmp)
        r = MiMoV2FlashForCausalLM.from_pretrained(tmp, dtype=torch.float64, attn_implementation="eager")
        set_eager(r).eval()
        checks["hub_tensors_via_transformers_rel_err"] = rel_err(forward_logits(r, prompt), logits)
        print(f"  hub tensors via transformers rel err {checks['hub_tensors_via_transformers_rel_err']:.3g}")
        if checks["hub_tensors_via_transformers_rel_err"] > 1e-6:
            SUMMARY["errors"].append(f"mimo_hub_f32 tensors via transformers mismatch")
        shutil.rmtree(tmp)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        SUMMARY["errors"].append(f"mimo_hub_f32 tensors via transformers failed: {e!r}")
    SUMMARY["fixtures"]["mimo_native_f32"] = {
        "tensors": native_desc, "files": sorted(os.listdir(d)), "prompt_seed": seed, "router_gap": gap,
        "margins": margins, "checks": checks,
        "in_memory": {k: [str(v.dtype), list(v.shape)] for k, v in sd32.items()},
    }
    SUMMARY["fixtures"]["mimo_hub_f32"] = {"tensors": describe_checkpoint(dh), "files": sorted(os.listdir(dh))}


# Routing of the FP8 fixture, which the GPU suite also runs with bf16 activations (the checkpoint's
# dtype): bf16 rounding of the residual stream moves router scores by ~1e-2, and random routers
# leave top-k selection gaps of ~1e-3, so experts flipped and logits differed by 0.56. Here the
# correction bias takes levels FP8_BIAS_STEP apart, more than the sigmoid scores' range of 1, so
# each layer selects the same experts for every token (a different set per layer) with gaps of at
# least FP8_BIAS_STEP - 1; the routing weights still vary per token. Token-dependent selection is
# covered by the f32 fixtures.
FP8_BIAS_STEP = 1.2
FP8_ROUTER_GAP = 0.1
# The bf16 run's error grows with attention sharpness; the f32 fixtures keep the sharper 1.4.
FP8_QK_GAIN = 1.0


def separate_routing(model, seed, E):
    g = torch.Generator().manual_seed(seed)
    levels = (torch.arange(E, dtype=torch.float32) - (E - 1) / 2) * FP8_BIAS_STEP
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                t.copy_(levels[torch.randperm(E, generator=g)])


def gen_mimo_fp8(root):
    from transformers import MiMoV2FlashForCausalLM

    p = MIMO_FP8
    H, I, E = p["hidden_size"], p["moe_intermediate_size"], p["n_routed_experts"]
    cfg = native_config(p)
    model = build_model(MiMoV2FlashForCausalLM, cfg)
    randomize(model, 5678, H, qk_gain=FP8_QK_GAIN)
    separate_routing(model, 5679, E)
    sd32 = {k: v.clone() for k, v in model.state_dict().items()}
    native_shapes = {k: tuple(v.shape) for k, v in sd32.items()}
    hub = native_to_hub(sd32, H, I)
    hc0 = hub_config(p, "bfloat16")
    hub.update(mtp_tensors(hc0, 8765, torch.float32))

    full_layers = {L for L, t in enumerate(p["layer_types"]) if t == "full_attention"}
    stored, deq, not_conv = {}, {}, []
    for n in sorted(hub):
        t = hub[n]
        quant = (t.dim() == 2 and not n.endswith("o_proj.weight") and not n.endswith("mlp.gate.weight")
                 and "embed_tokens" not in n and not n.startswith("lm_head") and "eh_proj" not in n)
        if quant:
            L = int(n.split(".")[2]) if n.startswith("model.layers.") else -1
            if n.endswith("self_attn.k_proj.weight") and L in full_layers:
                q, s = quantize_sharded(t, p["num_key_value_heads"])
            else:
                q, s = quantize_block(t)
            stored[n] = q
            stored[n + "_scale_inv"] = s
            deq[n] = dequantize(q, s)
        elif n.endswith("mlp.gate.weight") or n.endswith("e_score_correction_bias"):
            stored[n] = t.to(torch.float32)
            deq[n] = stored[n].to(torch.float64)
        else:
            stored[n] = t.to(torch.bfloat16)
            deq[n] = stored[n].to(torch.float64)
        if t.dim() == 2 and not quant:
            not_conv.append(n[: -len(".weight")])
    quant_cfg = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                 "weight_block_size": [128, 128], "modules_to_not_convert": sorted(not_conv)}
    hc = hub_config(p, "bfloat16", quant_cfg)

    d = os.path.join(root, "mimo_hub_fp8")
    os.makedirs(d, exist_ok=True)
    json.dump(hc, open(os.path.join(d, "config.json"), "w"), indent=2)
    first = {n for n in stored if n.startswith("model.embed_tokens") or n.startswith("model.layers.0.")
             or n.startswith("model.layers.1.")}
    shards = [{n: stored[n] for n in sorted(first)}, {n: stored[n] for n in sorted(set(stored) - first)}]
    wm, total = {}, 0
    for i, sh in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += write_safetensors(os.path.join(d, fn), sh)
        for n in sh:
            wm[n] = fn
    json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(wm.items()))},
              open(os.path.join(d, "model.safetensors.index.json"), "w"), indent=2)

    # reference model: native class in float64 with exactly the dequantised / upcast values
    m64 = copy.deepcopy(model).double()
    set_eager(m64)
    m64.load_state_dict(hub_to_native(deq, native_shapes, H, I, E), strict=True)
    seed, prompt, ids, margins, gap = choose_prompt(m64, p["vocab_size"], 40, "mimo", mimo_rcfg(p), 200,
                                                    min_router_gap=FP8_ROUTER_GAP)
    logits, hid = reference(m64, prompt)
    print(f"  logits std {float(logits.std()):.3f}")
    q_err = max(rel_err(deq[n], hub[n]) for n in deq if n + "_scale_inv" in stored)
    notes = ("Hub dialect, FP8 e4m3 weights with 128x128 block scales (weight_scale_inv = multiplier, "
             "blockmax/448); full-attention k_proj quantised per KV-head shard (grid restarts every "
             f"{p['head_dim']} rows, scale_inv rows = num_key_value_heads * ceil(head_dim/128)); bf16 embed/"
             "lm_head/o_proj/norms/sinks/eh_proj, f32 router weight and bias; MTP block 0 included (skip it). "
             "Reference: transformers MiMoV2FlashForCausalLM in float64 whose weights are exactly the "
             "dequantised fp8 values and the upcast bf16/f32 values (transformers' FP8 integration NOT used). "
             f"n_group 1, routed_scaling_factor null (=1.0) as in the real checkpoint. Correction bias on levels "
             f"{FP8_BIAS_STEP} apart: a fixed expert set per layer, so bf16 runs keep the selection. Prompt seed {seed}; "
             f"minimum MoE selection gap {gap:.3g}. Max relative quantisation error of a weight {q_err:.3g}.")
    write_reference(d, prompt, ids, margins, logits, hid, notes)

    checks = {}
    hub_read = read_checkpoint(d)
    deq_read = {}
    for n, t in hub_read.items():
        if n.endswith("_scale_inv"):
            continue
        deq_read[n] = dequantize(t, hub_read[n + "_scale_inv"]) if n + "_scale_inv" in hub_read else t.to(
            torch.float64)
    checks["manual_vs_ref"] = check_manual("mimo_hub_fp8", deq_read, hc, prompt, logits)
    kname = f"model.layers.{min(full_layers)}.self_attn.k_proj.weight_scale_inv"
    print(f"  {kname} shape {list(hub_read[kname].shape)}")
    SUMMARY["fixtures"]["mimo_hub_fp8"] = {
        "tensors": describe_checkpoint(d), "files": sorted(os.listdir(d)), "prompt_seed": seed,
        "router_gap": gap, "margins": margins, "checks": checks, "max_quant_rel_err": q_err,
    }


def gen_qwen3(root):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-6,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attention_bias=False, use_sliding_window=False, bos_token_id=1, eos_token_id=2,
    )
    model = build_model(Qwen3ForCausalLM, cfg)
    randomize(model, 91, 64)
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    d = os.path.join(root, "qwen3_f32")
    model.save_pretrained(d, safe_serialization=True)
    desc = describe_checkpoint(d)
    m64 = copy.deepcopy(model).double()
    set_eager(m64)
    seed, prompt, ids, margins, _ = choose_prompt(m64, 512, 32, "qwen3", None, 300)
    logits, hid = reference(m64, prompt)
    notes = (f"Qwen3ForCausalLM, random f32 weights (seed 91) incl. q_norm/k_norm, tie_word_embeddings true "
             f"(in memory tied: {tied}; lm_head.weight written: {'lm_head.weight' in desc}). Prompt seed {seed}. "
             "Reference float64, eager attention, greedy by full recompute.")
    write_reference(d, prompt, ids, margins, logits, hid, notes)
    checks = {}
    try:
        r = Qwen3ForCausalLM.from_pretrained(d, dtype=torch.float64, attn_implementation="eager")
        set_eager(r).eval()
        checks["reload_rel_err"] = rel_err(forward_logits(r, prompt), logits)
        print(f"  reload rel err {checks['reload_rel_err']:.3g}")
        if checks["reload_rel_err"] > 1e-6:
            SUMMARY["errors"].append(f"qwen3_f32 reload mismatch {checks['reload_rel_err']}")
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        SUMMARY["errors"].append(f"qwen3_f32 reload failed: {e!r}")
    SUMMARY["fixtures"]["qwen3_f32"] = {"tensors": desc, "files": sorted(os.listdir(d)), "prompt_seed": seed,
                                        "margins": margins, "checks": checks, "tied_in_memory": tied}


def gen_qwen3_moe(root):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-6,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        attention_bias=False, use_sliding_window=False, decoder_sparse_step=2, mlp_only_layers=[0, 3],
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=True,
        output_router_logits=False, bos_token_id=1, eos_token_id=2,
    )
    model = build_model(Qwen3MoeForCausalLM, cfg)
    randomize(model, 77, 64)
    moe_layers = [i for i, l in enumerate(model.model.layers) if hasattr(l.mlp, "experts")]
    print(f"  MoE layers: {moe_layers}")
    d = os.path.join(root, "qwen3_moe_f32")
    model.save_pretrained(d, safe_serialization=True)
    desc = describe_checkpoint(d)
    m64 = copy.deepcopy(model).double()
    set_eager(m64)
    seed, prompt, ids, margins, gap = choose_prompt(m64, 512, 32, "qwen3_moe", {"top_k": 2}, 400)
    logits, hid = reference(m64, prompt)
    notes = (f"Qwen3MoeForCausalLM, random f32 weights (seed 77), untied. decoder_sparse_step 2, mlp_only_layers "
             f"[0, 3] -> MoE layers {moe_layers} (layer i is MoE iff i not in mlp_only_layers and "
             f"(i+1) % decoder_sparse_step == 0), the others dense (intermediate_size). head_dim 24 != "
             f"hidden/heads. Prompt seed {seed}; minimum router top-k logit gap {gap:.3g}.")
    write_reference(d, prompt, ids, margins, logits, hid, notes, {"moe_layers": moe_layers})
    checks = {}
    try:
        r = Qwen3MoeForCausalLM.from_pretrained(d, dtype=torch.float64, attn_implementation="eager")
        set_eager(r).eval()
        checks["reload_rel_err"] = rel_err(forward_logits(r, prompt), logits)
        print(f"  reload rel err {checks['reload_rel_err']:.3g}")
        if checks["reload_rel_err"] > 1e-6:
            SUMMARY["errors"].append(f"qwen3_moe_f32 reload mismatch {checks['reload_rel_err']}")
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        SUMMARY["errors"].append(f"qwen3_moe_f32 reload failed: {e!r}")
    SUMMARY["fixtures"]["qwen3_moe_f32"] = {
        "tensors": desc, "files": sorted(os.listdir(d)), "prompt_seed": seed, "router_gap": gap,
        "margins": margins, "checks": checks, "moe_layers": moe_layers,
        "in_memory": {k: [str(v.dtype), list(v.shape)] for k, v in model.state_dict().items()},
    }


def dump_sources(out):
    """Tar the transformers sources these fixtures depend on (for reading on the dev machine)."""
    base = os.path.dirname(transformers.__file__)
    rels = ["models/mimo_v2_flash", "models/qwen3", "models/qwen3_moe", "models/qwen2_moe/modeling_qwen2_moe.py",
            "masking_utils.py", "conversion_mapping.py", "integrations/moe.py", "modeling_rope_utils.py",
            "core_model_loading.py"]
    with tarfile.open(os.path.join(out, "src.tar"), "w") as tf:
        for r in rels:
            pth = os.path.join(base, r)
            if os.path.exists(pth):
                tf.add(pth, arcname=r, filter=lambda ti: None if "__pycache__" in ti.name else ti)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    torch.set_num_threads(min(8, os.cpu_count() or 1))
    print(GEN)
    os.makedirs(args.out, exist_ok=True)
    try:
        dump_sources(args.out)
    except Exception as e:  # noqa: BLE001
        print(f"source dump failed: {e!r}")
    root = os.path.join(tempfile.mkdtemp(), "fixtures")
    os.makedirs(root)
    gens = [("mimo_native_f32+mimo_hub_f32", gen_mimo_native_and_hub), ("mimo_hub_fp8", gen_mimo_fp8),
            ("qwen3_f32", gen_qwen3), ("qwen3_moe_f32", gen_qwen3_moe)]
    for name, fn in gens:
        if args.only and args.only not in name:
            continue
        print(f"== {name}")
        try:
            fn(root)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            SUMMARY["errors"].append(f"{name}: {e!r}")
    with tarfile.open(os.path.join(args.out, "fixtures.tar"), "w") as tf:
        tf.add(root, arcname="fixtures")
    sizes = {}
    for dp, _, fns in os.walk(root):
        for fn in fns:
            sizes[os.path.relpath(os.path.join(dp, fn), root)] = os.path.getsize(os.path.join(dp, fn))
    SUMMARY["sizes"] = sizes
    SUMMARY["total_bytes"] = sum(sizes.values())
    json.dump(SUMMARY, open(os.path.join(args.out, "summary.json"), "w"), indent=1)
    print(f"total fixture bytes {SUMMARY['total_bytes']}")
    print("ERRORS:" if SUMMARY["errors"] else "no errors", *SUMMARY["errors"], sep="\n  ")
    return 1 if SUMMARY["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
