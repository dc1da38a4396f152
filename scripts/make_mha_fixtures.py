#!/usr/bin/python3
"""Writes tests/fixtures/mha_torch.safetensors: PyTorch's nn.MultiheadAttention (and GQA/MQA built from it) in float64.

Run with Debian's interpreter, which has the packages (a pyenv `python3` first on PATH may not):

    apt-get install -y python3-torch python3-numpy     # PyTorch 1.13, NumPy 1.24 on Debian 12
    /usr/bin/python3 scripts/make_mha_fixtures.py [--output tests/fixtures/mha_torch.safetensors]

Each case stores its inputs, its parameters in PyTorch's own layout ([out, in] weights, the packed in_proj_bias) and
PyTorch's outputs; tests/test_multi_head.cpp loads the parameters with MultiHeadAttention::load_pytorch and compares.
Everything is float64 (the module is put in double), so the expected values carry no float32 rounding. The file is
safetensors (scripts/safetensors_writer.py; tests/fixtures/README.md). The output is deterministic (fixed seeds, single
thread).

Cases (names are the prefixes of the arrays, `<case>.<array>`):
  self            self-attention, seq-first [L, N, E], averaged weights
  cross           cross-attention (key = value = memory, S != L), per-head weights (average_attn_weights=False)
  key_padding     boolean key_padding_mask: right padding, holes, and one batch entry with every key padded (NaN rows)
  bool_mask       boolean 2-D attn_mask (True = masked) with one fully masked row (NaN row), per-head weights
  bool_mask_3d    boolean 3-D attn_mask [N*H, L, S]: a different mask per batch entry and head
  float_mask      float 2-D attn_mask (with some -inf) plus a boolean key_padding_mask
  float_padding   float key_padding_mask (added to the scores)
  batch_first     batch_first=True, causal attn_mask (torch.triu), L = S
  kdim_vdim       kdim = 5, vdim = 7 != embed_dim = 12: PyTorch's separate q/k/v weights; averaged weights
  no_bias         bias=False
  gqa, gqa_causal grouped-query attention (6 query heads, 2 kv heads) built from nn.Linear by repeating K/V heads
  mqa_cross       multi-query attention (6 query heads, 1 kv head), cross-attention

Tensor names per case: config (F64: d_model, n_heads, n_kv_heads, kdim, vdim, bias, batch_first, N, L, S),
query, key, value (PyTorch layout: [L, N, E] or, batch_first, [N, L, E]), in_proj_weight or q/k/v_proj_weight,
in_proj_bias, out_proj_weight, out_proj_bias, optional key_padding_mask (BOOL or F64, [N, S]), attn_mask (BOOL or F64),
and the outputs out (PyTorch layout) and weights ([N, L, S] averaged, or [N, H, L, S] per head).
"""
import argparse
import math
import pathlib

import numpy as np
import torch

from safetensors_writer import write_safetensors


def randomize_biases(module):
    """PyTorch initializes the biases to zero; random ones test that the bias is added where it belongs."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if 'bias' in name:
                p.uniform_(-0.5, 0.5)


def np64(t):
    return t.detach().numpy().astype('<f8')


def mha_case(arrays, case, *, E, H, L, S, N, kdim=None, vdim=None, bias=True, batch_first=False, cross=False,
             key_padding_mask=None, attn_mask=None, average=True):
    torch.manual_seed(1000 + len(arrays))
    mha = torch.nn.MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first).double().eval()
    if bias:
        randomize_biases(mha)
    kd, vd = kdim or E, vdim or E

    def shape(T, width):
        return (N, T, width) if batch_first else (T, N, width)

    query = torch.randn(*shape(L, E), dtype=torch.float64)
    if kdim is not None or vdim is not None:
        key = torch.randn(*shape(S, kd), dtype=torch.float64)
        value = torch.randn(*shape(S, vd), dtype=torch.float64)
    elif cross:
        key = value = torch.randn(*shape(S, E), dtype=torch.float64)
    else:
        assert L == S
        key = value = query
    with torch.no_grad():
        # need_weights=True keeps PyTorch off its fast path (which zeroes padded query rows of nested tensors).
        out, weights = mha(query, key, value, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                           need_weights=True, average_attn_weights=average)
    arrays[f'{case}.config'] = np.array([E, H, H, kd, vd, int(bias), int(batch_first), N, L, S], dtype='<f8')
    arrays[f'{case}.query'] = np64(query)
    arrays[f'{case}.key'] = np64(key)
    arrays[f'{case}.value'] = np64(value)
    if mha._qkv_same_embed_dim:
        arrays[f'{case}.in_proj_weight'] = np64(mha.in_proj_weight)
    else:
        arrays[f'{case}.q_proj_weight'] = np64(mha.q_proj_weight)
        arrays[f'{case}.k_proj_weight'] = np64(mha.k_proj_weight)
        arrays[f'{case}.v_proj_weight'] = np64(mha.v_proj_weight)
    arrays[f'{case}.in_proj_bias'] = np64(mha.in_proj_bias) if bias else np.zeros(0, dtype='<f8')
    arrays[f'{case}.out_proj_weight'] = np64(mha.out_proj.weight)
    arrays[f'{case}.out_proj_bias'] = np64(mha.out_proj.bias) if bias else np.zeros(0, dtype='<f8')
    for name, mask in (('key_padding_mask', key_padding_mask), ('attn_mask', attn_mask)):
        if mask is not None:
            arrays[f'{case}.{name}'] = mask.numpy() if mask.dtype == torch.bool else np64(mask)
    arrays[f'{case}.out'] = np64(out)
    arrays[f'{case}.weights'] = np64(weights)


def gqa_case(arrays, case, *, E, Hq, Hkv, L, S, N, cross, causal):
    """GQA/MQA in PyTorch 1.13 (which has neither): nn.Linear projections with Hkv key/value heads, the K/V heads
    repeated so that query head h reads kv head h // (Hq // Hkv), then the same arithmetic as nn.MultiheadAttention.
    The parameters are stored in nn.MultiheadAttention's packed form, in_proj_weight = [W_q; W_k; W_v] ([out, in])."""
    torch.manual_seed(2000 + len(arrays))
    hd = E // Hq
    group = Hq // Hkv
    q_proj = torch.nn.Linear(E, Hq * hd).double()
    k_proj = torch.nn.Linear(E, Hkv * hd).double()
    v_proj = torch.nn.Linear(E, Hkv * hd).double()
    out_proj = torch.nn.Linear(Hq * hd, E).double()
    for module in (q_proj, k_proj, v_proj, out_proj):
        randomize_biases(module)
    query = torch.randn(L, N, E, dtype=torch.float64)
    key = torch.randn(S, N, E, dtype=torch.float64) if cross else query
    attn_mask = torch.ones(L, S, dtype=torch.bool).triu(1) if causal else None  # True = masked (top-left diagonal)

    def attention(query, key, q_w, q_b, k_w, k_b, v_w, v_b, o_w, o_b, heads_q, heads_kv):
        g = heads_q // heads_kv
        q = torch.nn.functional.linear(query, q_w, q_b).reshape(L, N, heads_q, hd).permute(1, 2, 0, 3)
        k = torch.nn.functional.linear(key, k_w, k_b).reshape(S, N, heads_kv, hd).permute(1, 2, 0, 3)
        v = torch.nn.functional.linear(key, v_w, v_b).reshape(S, N, heads_kv, hd).permute(1, 2, 0, 3)
        k = k.repeat_interleave(g, dim=1)  # [N, Hq, S, hd]: query head h reads kv head h // g
        v = v.repeat_interleave(g, dim=1)
        scores = (q / math.sqrt(hd)) @ k.transpose(-2, -1)
        if attn_mask is not None:
            scores = scores.masked_fill(attn_mask, float('-inf'))
        p = torch.softmax(scores, dim=-1)
        o = (p @ v).permute(2, 0, 1, 3).reshape(L, N, heads_q * hd)
        return torch.nn.functional.linear(o, o_w, o_b), p

    with torch.no_grad():
        out, p = attention(query, key, q_proj.weight, q_proj.bias, k_proj.weight, k_proj.bias, v_proj.weight,
                           v_proj.bias, out_proj.weight, out_proj.bias, Hq, Hkv)
        # Self-check of the formulation: with Hkv = Hq heads it must reproduce nn.MultiheadAttention.
        mha = torch.nn.MultiheadAttention(E, Hq).double().eval()
        randomize_biases(mha)
        w, b = mha.in_proj_weight, mha.in_proj_bias
        mine, _ = attention(query, key, w[:E], b[:E], w[E:2 * E], b[E:2 * E], w[2 * E:], b[2 * E:],
                            mha.out_proj.weight, mha.out_proj.bias, Hq, Hq)
        theirs, _ = mha(query, key, key, attn_mask=attn_mask, need_weights=True)
        assert torch.allclose(mine, theirs, rtol=0, atol=1e-12), (mine - theirs).abs().max()
    arrays[f'{case}.config'] = np.array([E, Hq, Hkv, E, E, 1, 0, N, L, S], dtype='<f8')
    arrays[f'{case}.query'] = np64(query)
    arrays[f'{case}.key'] = np64(key)
    arrays[f'{case}.value'] = np64(key)
    arrays[f'{case}.in_proj_weight'] = np64(torch.cat([q_proj.weight, k_proj.weight, v_proj.weight]))
    arrays[f'{case}.in_proj_bias'] = np64(torch.cat([q_proj.bias, k_proj.bias, v_proj.bias]))
    arrays[f'{case}.out_proj_weight'] = np64(out_proj.weight)
    arrays[f'{case}.out_proj_bias'] = np64(out_proj.bias)
    if attn_mask is not None:
        arrays[f'{case}.attn_mask'] = attn_mask.numpy()
    arrays[f'{case}.out'] = np64(out)
    arrays[f'{case}.weights'] = np64(p)  # [N, Hq, L, S]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--output', default=str(pathlib.Path(__file__).resolve().parent.parent / 'tests' /
                                                'fixtures' / 'mha_torch.safetensors'))
    args = parser.parse_args()
    torch.set_num_threads(1)
    arrays = {}

    mha_case(arrays, 'self', E=12, H=3, L=5, S=5, N=2)
    mha_case(arrays, 'cross', E=12, H=4, L=4, S=7, N=2, cross=True, average=False)

    kpm = torch.zeros(3, 6, dtype=torch.bool)
    kpm[0, 4:] = True            # right padding: 4 real keys
    kpm[1, [1, 4]] = True        # holes
    kpm[2, :] = True             # every key padded: PyTorch gives NaN rows
    mha_case(arrays, 'key_padding', E=12, H=3, L=6, S=6, N=3, key_padding_mask=kpm)

    g = torch.Generator().manual_seed(7)
    bool_mask = torch.rand(5, 6, generator=g) < 0.4
    bool_mask[2, :] = True       # a fully masked query row: NaN in PyTorch
    bool_mask[:, 0] &= torch.arange(5) == 2  # the other rows keep key 0 visible
    mha_case(arrays, 'bool_mask', E=12, H=3, L=5, S=6, N=2, cross=True, attn_mask=bool_mask, average=False)

    mask_3d = torch.rand(2 * 3, 4, 5, generator=g) < 0.5
    mask_3d[:, :, 2] = False     # every row keeps key 2
    mha_case(arrays, 'bool_mask_3d', E=12, H=3, L=4, S=5, N=2, cross=True, attn_mask=mask_3d, average=False)

    float_mask = torch.randn(5, 6, generator=g, dtype=torch.float64)
    float_mask[1, 3] = float('-inf')
    float_mask[4, 0] = float('-inf')
    kpm_f = torch.zeros(2, 6, dtype=torch.bool)
    kpm_f[1, 5] = True
    mha_case(arrays, 'float_mask', E=12, H=3, L=5, S=6, N=2, cross=True, attn_mask=float_mask,
             key_padding_mask=kpm_f)

    float_padding = torch.randn(2, 5, generator=g, dtype=torch.float64)
    mha_case(arrays, 'float_padding', E=12, H=3, L=5, S=5, N=2, key_padding_mask=float_padding)

    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)
    mha_case(arrays, 'batch_first', E=16, H=4, L=6, S=6, N=3, batch_first=True, attn_mask=causal)

    mha_case(arrays, 'kdim_vdim', E=12, H=3, L=4, S=6, N=2, kdim=5, vdim=7)
    mha_case(arrays, 'no_bias', E=8, H=2, L=5, S=5, N=2, bias=False, average=False)

    gqa_case(arrays, 'gqa', E=24, Hq=6, Hkv=2, L=7, S=7, N=2, cross=False, causal=False)
    gqa_case(arrays, 'gqa_causal', E=24, Hq=6, Hkv=2, L=7, S=7, N=1, cross=False, causal=True)
    gqa_case(arrays, 'mqa_cross', E=24, Hq=6, Hkv=1, L=5, S=8, N=2, cross=True, causal=False)

    write_safetensors(args.output, arrays, {'generator': 'scripts/make_mha_fixtures.py', 'torch': torch.__version__})
    print(f'wrote {args.output}: {len(arrays)} tensors, torch {torch.__version__}')


if __name__ == '__main__':
    main()
