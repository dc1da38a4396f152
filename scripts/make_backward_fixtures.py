#!/usr/bin/python3
"""Writes tests/fixtures/backward_torch.safetensors: attention gradients by PyTorch autograd in float64.

Run with Debian's interpreter, which has the packages (a pyenv `python3` first on PATH may not):

    apt-get install -y python3-torch python3-numpy     # PyTorch 1.13, NumPy 1.24 on Debian 12
    /usr/bin/python3 scripts/make_backward_fixtures.py [--output tests/fixtures/backward_torch.safetensors]

Issue 17 (the backward pass): qkv::attention_backward and MultiHeadAttention::backward are checked against PyTorch's
autograd. Every case draws its inputs in float32 (fixed seeds) and widens them exactly to float64, so the float tests
run on exactly the values the float64 expectations were computed from; the options (scale, softcap, bias, ALiBi
slopes, sinks) are float32 values too. The attention is written out in PyTorch's own operations in float64 (scores,
softcap as c·tanh(x/c), masks as masked_fill with −∞, softmax, P·V, logsumexp), the loss is Σ out ∘ d_out with a
random d_out, and autograd gives the gradients. Dropout-free (PyTorch's CPU dropout is not Philox). The file is
safetensors (scripts/safetensors_writer.py; tests/fixtures/README.md). The output is deterministic (fixed seeds, single
thread).

qkv's options are translated into PyTorch as README.md's "Semantics" states them (per batch entry b, Skv_b its key
count after key padding):
  scale                 s = (q·kᵀ)·scale, unset = 1/√D
  softcap c             s ← c·tanh(s / c), on the scaled dot product, before bias and ALiBi
  bias                  s ← s + bias (a leaf tensor: its gradient is d_bias, summed over its broadcast axes)
  ALiBi                 s ← s − slope_h·|diag(i) − j| (a constant bias, no gradient)
  causal top-left       hidden where j > i: torch.ones(Sq, Skv).tril() (PyTorch's is_causal)
  causal bottom-right   hidden where j > i + Skv_b − Sq: torch.ones(Sq, Skv).tril(diagonal=Skv_b − Sq)
  window                hidden outside [diag(i) − window_left, diag(i) + window_right], keys j < global_tokens exempt
  key_lengths           hidden where j ≥ key_lengths[b]
  allowed               hidden where not allowed (PyTorch's boolean masks mean the opposite: True = masked)
  sinks                 an extra logit column sink_h joins the softmax and is dropped after it (a leaf: d_sinks)
  varlen                each sequence computed on its own rows and concatenated
  GQA                   k and v repeated with repeat_interleave(Hq / Hkv, dim=1): query head h reads kv head h // G
A row that sees no key (and no finite sink) is zeros with lse = −∞ (qkv's rule; PyTorch would give NaN): the
generator selects such rows away before the softmax so that no NaN enters autograd.

Core cases (names are the prefixes of the arrays, `<case>.<array>`), q [B, Hq, Sq, D], k [B, Hkv, Skv, D],
v [B, Hkv, Skv, Dv] (BHSD):
  plain               B 2, Hq 2, Hkv 2, Sq 5, Skv 7, D 8, Dv 6
  gqa_top_left        B 1, Hq 6, Hkv 2, Sq 9, Skv 6, D 5, Dv 7, causal top-left, scale 0.3
  mqa_bottom_right    B 2, Hq 4, Hkv 1, Sq 5, Skv 11, D 16, Dv 8, causal bottom-right
  empty_rows          B 1, Hq 2, Hkv 1, Sq 7, Skv 4, D 3, Dv 5, causal bottom-right (rows 0-2 see no key)
  allowed_padding     B 2, Hq 3, Hkv 3, Sq 6, Skv 9, D 4, Dv 4, `allowed` [B, 1, Sq, Skv] with a fully masked row,
                      key_lengths 9 and 5
  bias                B 2, Hq 2, Hkv 1, Sq 6, Skv 8, D 6, Dv 3, bias [1, Hq, Sq, Skv] with −∞ entries (d_bias)
  bias_key_row        B 2, Hq 4, Hkv 2, Sq 3, Skv 10, D 4, Dv 4, bias [B, 1, 1, Skv] (d_bias), causal top-left
  softcap             B 1, Hq 3, Hkv 3, Sq 8, Skv 8, D 12, Dv 5, softcap 5, scale 1.5
  alibi               B 2, Hq 4, Hkv 2, Sq 6, Skv 9, D 8, Dv 8, ALiBi, causal bottom-right, key_lengths 9 and 7
  alibi_top_left      B 1, Hq 2, Hkv 2, Sq 7, Skv 5, D 4, Dv 6, ALiBi without causal, top-left diagonal
  sinks               B 2, Hq 4, Hkv 2, Sq 5, Skv 6, D 8, Dv 4, sinks (one −∞) (d_sinks), causal bottom-right
  window_global       B 1, Hq 2, Hkv 1, Sq 12, Skv 12, D 6, Dv 6, window 3 left 1 right, 2 global tokens
  scale_zero          B 1, Hq 2, Hkv 2, Sq 4, Skv 5, D 3, Dv 3, scale 0 (the mean of the visible values)
  varlen              B 1 (views), Hq 4, Hkv 2, D 5, Dv 6, cu_seqlens_q [0, 3, 3, 8], cu_seqlens_k [0, 4, 9, 13],
                      causal bottom-right (the second sequence has keys and no query: their gradients are zero)
  everything          B 2, Hq 6, Hkv 3, Sq 7, Skv 10, D 8, Dv 5, softcap 10, bias [B, Hq, Sq, Skv], ALiBi, sinks,
                      key_lengths 10 and 6, causal bottom-right, scale 0.4 (d_bias, d_sinks)
Tensor names per core case: config (F64: B, Hq, Hkv, Sq, Skv, D, Dv, scale (NaN = unset), softcap, causal,
alignment (0 = bottom-right, 1 = top-left), window_left, window_right, global_tokens), q, k, v, d_out, optional
key_lengths (F64, [B]), allowed (BOOL, qkv's meaning: true = may attend), bias, alibi_slopes ([Hq]), sinks ([Hq]),
cu_seqlens_q and cu_seqlens_k (F64), and the float64 results out [B, Hq, Sq, Dv], lse [B, Hq, Sq] (natural log,
−∞ for a row that sees nothing), d_q, d_k, d_v, and d_bias (the bias's shape) / d_sinks ([Hq]) where those exist.

Module cases: qkv::MultiHeadAttention's own parameters (weights [in, out], MultiHeadAttention's layout, so the
gradients are in that layout too), written as PyTorch operations on leaf tensors: Q = X_q·W_q + b_q,
K = X_k·W_k + b_k, V = X_v·W_v + b_v, heads of head_dim columns, query head h reading kv head h // G,
O = softmax(Q_h·K_{h//G}ᵀ/√head_dim + mask)·V_{h//G} side by side, Y = O·W_o + b_o; the loss is Σ Y ∘ dY. With
n_kv_heads = n_heads that arithmetic is checked against nn.MultiheadAttention (weights transposed into it).
  module_self         self-attention forward(X): d_model 12, 3 heads, T 6, biases, causal
  module_gqa          self-attention: d_model 24, 6 query heads, 2 kv heads, T 7, no biases
  module_cross_kv     forward(X_q, X_kv): d_model 12, 4 query heads, 2 kv heads, L 4, S 7, biases
  module_cross        forward(X_q, X_k, X_v): d_model 12, 4 heads, kdim 5, vdim 7, L 5, S 6, biases
Tensor names per module case: config (F64: d_model, n_heads, n_kv_heads, kdim, vdim, bias, causal, L, S, inputs
(1 = X, 2 = X_q and X_kv, 3 = X_q, X_k, X_v)), the inputs X or X_q / X_kv / X_k / X_v ([T, width]), W_q, W_k, W_v,
W_o, b_q, b_k, b_v, b_o (0 entries without biases), dY, and the results Y, dX or dX_q / dX_kv / dX_k / dX_v, dW_q,
dW_k, dW_v, dW_o, db_q, db_k, db_v, db_o.
"""
import argparse
import math
import pathlib

import numpy as np
import torch

from safetensors_writer import write_safetensors

INF = float('inf')


def f32(x):
    """A float32 value as a Python float (exact in float64)."""
    return float(np.float32(x))


def draw(generator, *shape, scale=1.0):
    """N(0, scale²) draws rounded to float32, widened exactly to float64."""
    return (torch.randn(*shape, generator=generator) * scale).float().double()


def np64(t):
    return t.detach().numpy().astype('<f8')


def grad_or_zeros(t):
    return t.grad if t.grad is not None else torch.zeros_like(t)


def attend(q, k, v, *, scale, softcap, causal, top_left, window, global_tokens, key_lengths, allowed, bias, alibi,
           sinks):
    """Attention of one block of rows in PyTorch float64: q [B, Hq, Sq, D], k [B, Hkv, Skv, D], v [B, Hkv, Skv, Dv];
    `allowed` a bool tensor broadcastable to [B, Hq, Sq, Skv] (true = may attend), `bias` a float tensor so
    broadcastable, `alibi` and `sinks` [Hq] tensors or None. Returns out [B, Hq, Sq, Dv] and lse [B, Hq, Sq]."""
    B, Hq, Sq, _ = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    k = k.repeat_interleave(group, dim=1)          # [B, Hq, Skv, D]: query head h reads kv head h // group
    v = v.repeat_interleave(group, dim=1)
    s = (q @ k.transpose(-2, -1)) * scale          # q·k·scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    lengths = key_lengths if key_lengths is not None else [Skv] * B
    i = torch.arange(Sq).reshape(Sq, 1)
    j = torch.arange(Skv).reshape(1, Skv)
    hidden = torch.zeros(B, Hq, Sq, Skv, dtype=torch.bool)
    distance = torch.zeros(B, 1, Sq, Skv, dtype=torch.float64)
    for b, length in enumerate(lengths):
        diag = i if top_left else i + (length - Sq)  # the causal diagonal of query i
        if causal:
            # top-left: torch.ones(Sq, Skv).tril() (PyTorch's is_causal); bottom-right: .tril(diagonal=Skv_b - Sq)
            keep = torch.ones(Sq, Skv, dtype=torch.bool).tril(diagonal=0 if top_left else length - Sq)
            assert torch.equal(keep, j <= diag)
            hidden[b] |= ~keep
        if window[0] >= 0:
            hidden[b] |= (j < diag - window[0]) & (j >= global_tokens)
        if window[1] >= 0:
            hidden[b] |= (j > diag + window[1]) & (j >= global_tokens)
        hidden[b, :, :, length:] = True              # key padding
        distance[b, 0] = (diag - j).abs().double()
    if allowed is not None:
        hidden |= ~allowed
    if bias is not None:
        hidden |= torch.isneginf(bias.detach()).expand(B, Hq, Sq, Skv)
    if alibi is not None:
        s = s - alibi.reshape(1, Hq, 1, 1) * distance
    s = s.masked_fill(hidden, -INF)
    if sinks is not None:
        s = torch.cat([s, sinks.reshape(1, Hq, 1, 1).expand(B, Hq, Sq, 1)], dim=-1)  # the sink's logit column
        no_sink = torch.isneginf(sinks.detach()).reshape(1, Hq, 1).expand(B, Hq, Sq)
    else:
        no_sink = torch.ones(B, Hq, Sq, dtype=torch.bool)
    empty = hidden.all(dim=-1) & no_sink          # no visible key and no finite sink: zeros, lse = −∞
    s = s.masked_fill(empty.unsqueeze(-1), 0.0)   # selected away below: keeps NaN out of autograd
    p = torch.softmax(s, dim=-1)
    p = torch.where(empty.unsqueeze(-1), torch.zeros_like(p), p)
    lse = torch.where(empty, torch.full_like(empty, -INF, dtype=torch.float64), torch.logsumexp(s, dim=-1))
    out = p[..., :Skv] @ v                        # the sink carries no value: its weight is dropped
    return out, lse


def core_case(arrays, case, *, B, Hq, Hkv, Sq, Skv, D, Dv, scale=None, softcap=0.0, causal=False, top_left=False,
              window=(-1, -1), global_tokens=0, key_lengths=None, allowed=None, bias_shape=None, bias_minus_inf=0.0,
              alibi=None, sinks=None, cu_seqlens=None):
    g = torch.Generator().manual_seed(1700 + len(arrays))
    q = draw(g, B, Hq, Sq, D).requires_grad_()
    k = draw(g, B, Hkv, Skv, D).requires_grad_()
    v = draw(g, B, Hkv, Skv, Dv).requires_grad_()
    d_out = draw(g, B, Hq, Sq, Dv)
    bias = None
    if bias_shape is not None:
        bias = draw(g, *bias_shape)
        bias[torch.rand(*bias_shape, generator=g) < bias_minus_inf] = -INF
        bias.requires_grad_()
    scale_value = f32(scale) if scale is not None else 1.0 / math.sqrt(D)
    softcap = f32(softcap)
    alibi_t = torch.tensor([f32(x) for x in alibi], dtype=torch.float64) if alibi is not None else None
    sinks_t = torch.tensor([f32(x) for x in sinks], dtype=torch.float64).requires_grad_() if sinks is not None else None
    allowed_t = torch.from_numpy(allowed) if allowed is not None else None
    options = dict(scale=scale_value, softcap=softcap, causal=causal, top_left=top_left, window=window,
                   global_tokens=global_tokens, allowed=allowed_t, bias=bias, alibi=alibi_t, sinks=sinks_t)
    if cu_seqlens is None:
        out, lse = attend(q, k, v, key_lengths=key_lengths, **options)
    else:
        assert B == 1 and allowed is None and bias is None and key_lengths is None
        cu_q, cu_k = cu_seqlens
        outs, lses = [], []
        for s in range(len(cu_q) - 1):
            o, l = attend(q[:, :, cu_q[s]:cu_q[s + 1]], k[:, :, cu_k[s]:cu_k[s + 1]], v[:, :, cu_k[s]:cu_k[s + 1]],
                          key_lengths=None, **options)
            outs.append(o)
            lses.append(l)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
    (out * d_out).sum().backward()
    for name, t in (('out', out), ('lse', lse)):
        finite = t.detach()[torch.isfinite(t.detach())]
        assert not torch.isnan(t.detach()).any(), (case, name)
        assert finite.numel() > 0
    for t in (q, k, v):
        assert torch.isfinite(grad_or_zeros(t)).all(), case

    arrays[f'{case}.config'] = np.array([B, Hq, Hkv, Sq, Skv, D, Dv, scale_value if scale is not None else math.nan,
                                         softcap, int(causal), int(top_left), window[0], window[1], global_tokens],
                                        dtype='<f8')
    arrays[f'{case}.q'] = np64(q)
    arrays[f'{case}.k'] = np64(k)
    arrays[f'{case}.v'] = np64(v)
    arrays[f'{case}.d_out'] = np64(d_out)
    if key_lengths is not None:
        arrays[f'{case}.key_lengths'] = np.array(key_lengths, dtype='<f8')
    if allowed is not None:
        arrays[f'{case}.allowed'] = allowed
    if bias is not None:
        arrays[f'{case}.bias'] = np64(bias)
    if alibi_t is not None:
        arrays[f'{case}.alibi_slopes'] = np64(alibi_t)
    if sinks_t is not None:
        arrays[f'{case}.sinks'] = np64(sinks_t)
    if cu_seqlens is not None:
        arrays[f'{case}.cu_seqlens_q'] = np.array(cu_seqlens[0], dtype='<f8')
        arrays[f'{case}.cu_seqlens_k'] = np.array(cu_seqlens[1], dtype='<f8')
    arrays[f'{case}.out'] = np64(out)
    arrays[f'{case}.lse'] = np64(lse)
    arrays[f'{case}.d_q'] = np64(grad_or_zeros(q))
    arrays[f'{case}.d_k'] = np64(grad_or_zeros(k))
    arrays[f'{case}.d_v'] = np64(grad_or_zeros(v))
    if bias is not None:
        d_bias = grad_or_zeros(bias)
        assert torch.isfinite(d_bias).all()
        arrays[f'{case}.d_bias'] = np64(d_bias)
    if sinks_t is not None:
        arrays[f'{case}.d_sinks'] = np64(grad_or_zeros(sinks_t))


def module_attention(X_q, X_k, X_v, W_q, W_k, W_v, W_o, b_q, b_k, b_v, b_o, Hq, Hkv, causal):
    """MultiHeadAttention's forward in PyTorch float64 on [T, width] inputs and [in, out] weights."""
    L, S = X_q.shape[0], X_k.shape[0]
    head_dim = W_q.shape[1] // Hq
    Q, K, V = X_q @ W_q, X_k @ W_k, X_v @ W_v
    if b_q is not None:
        Q, K, V = Q + b_q, K + b_k, V + b_v
    q = Q.reshape(L, Hq, head_dim).transpose(0, 1)             # [Hq, L, head_dim]: head h is columns h·head_dim …
    k = K.reshape(S, Hkv, head_dim).transpose(0, 1).repeat_interleave(Hq // Hkv, dim=0)
    v = V.reshape(S, Hkv, head_dim).transpose(0, 1).repeat_interleave(Hq // Hkv, dim=0)
    s = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
    if causal:
        s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), -INF)  # L = S: both alignments agree
    o = (torch.softmax(s, dim=-1) @ v).transpose(0, 1).reshape(L, Hq * head_dim)
    Y = o @ W_o
    return Y + b_o if b_o is not None else Y


def module_case(arrays, case, *, E, Hq, Hkv, L, S, inputs, kdim=None, vdim=None, bias=True, causal=False):
    g = torch.Generator().manual_seed(1750 + len(arrays))
    kdim, vdim = kdim or E, vdim or E
    head_dim = E // Hq
    X_q = draw(g, L, E)
    if inputs == 1:
        assert L == S
        X_k = X_v = X_q
    elif inputs == 2:
        X_k = X_v = draw(g, S, E)
    else:
        X_k, X_v = draw(g, S, kdim), draw(g, S, vdim)
    leaves = {'X_q': X_q, 'X_kv': X_k} if inputs == 2 else {'X': X_q} if inputs == 1 else {
        'X_q': X_q, 'X_k': X_k, 'X_v': X_v}
    for t in leaves.values():
        t.requires_grad_()
    params = {
        'W_q': draw(g, E, Hq * head_dim, scale=1 / math.sqrt(E)),
        'W_k': draw(g, kdim, Hkv * head_dim, scale=1 / math.sqrt(kdim)),
        'W_v': draw(g, vdim, Hkv * head_dim, scale=1 / math.sqrt(vdim)),
        'W_o': draw(g, Hq * head_dim, E, scale=1 / math.sqrt(Hq * head_dim)),
    }
    if bias:
        params.update({'b_q': draw(g, Hq * head_dim, scale=0.5), 'b_k': draw(g, Hkv * head_dim, scale=0.5),
                       'b_v': draw(g, Hkv * head_dim, scale=0.5), 'b_o': draw(g, E, scale=0.5)})
    for t in params.values():
        t.requires_grad_()
    dY = draw(g, L, E)
    b = (lambda name: params[name]) if bias else (lambda name: None)
    Y = module_attention(X_q, X_k, X_v, params['W_q'], params['W_k'], params['W_v'], params['W_o'], b('b_q'),
                         b('b_k'), b('b_v'), b('b_o'), Hq, Hkv, causal)
    (Y * dY).sum().backward()

    if Hq == Hkv and kdim == E and vdim == E:
        # Self-check of the formulation: nn.MultiheadAttention with the weights transposed into it.
        with torch.no_grad():
            mha = torch.nn.MultiheadAttention(E, Hq, bias=bias).double().eval()
            mha.in_proj_weight.copy_(torch.cat([params['W_q'], params['W_k'], params['W_v']], dim=1).t())
            mha.out_proj.weight.copy_(params['W_o'].t())
            if bias:
                mha.in_proj_bias.copy_(torch.cat([params['b_q'], params['b_k'], params['b_v']]))
                mha.out_proj.bias.copy_(params['b_o'])
            mask = ~torch.ones(L, S, dtype=torch.bool).tril() if causal else None
            theirs, _ = mha(X_q.unsqueeze(1), X_k.unsqueeze(1), X_v.unsqueeze(1), attn_mask=mask, need_weights=True)
            assert torch.allclose(Y, theirs.squeeze(1), rtol=0, atol=1e-12), (Y - theirs.squeeze(1)).abs().max()

    arrays[f'{case}.config'] = np.array([E, Hq, Hkv, kdim, vdim, int(bias), int(causal), L, S, inputs], dtype='<f8')
    for name, t in leaves.items():
        arrays[f'{case}.{name}'] = np64(t)
    for name in ('W_q', 'W_k', 'W_v', 'W_o', 'b_q', 'b_k', 'b_v', 'b_o'):
        arrays[f'{case}.{name}'] = np64(params[name]) if name in params else np.zeros(0, dtype='<f8')
    arrays[f'{case}.dY'] = np64(dY)
    arrays[f'{case}.Y'] = np64(Y)
    for name, t in leaves.items():
        arrays[f'{case}.d{name}'] = np64(t.grad)
    for name in ('W_q', 'W_k', 'W_v', 'W_o', 'b_q', 'b_k', 'b_v', 'b_o'):
        arrays[f'{case}.d{name}'] = np64(params[name].grad) if name in params else np.zeros(0, dtype='<f8')


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--output', default=str(pathlib.Path(__file__).resolve().parent.parent / 'tests' /
                                                'fixtures' / 'backward_torch.safetensors'))
    args = parser.parse_args()
    torch.set_num_threads(1)
    arrays = {}

    core_case(arrays, 'plain', B=2, Hq=2, Hkv=2, Sq=5, Skv=7, D=8, Dv=6)
    core_case(arrays, 'gqa_top_left', B=1, Hq=6, Hkv=2, Sq=9, Skv=6, D=5, Dv=7, causal=True, top_left=True,
              scale=0.3)
    core_case(arrays, 'mqa_bottom_right', B=2, Hq=4, Hkv=1, Sq=5, Skv=11, D=16, Dv=8, causal=True)
    core_case(arrays, 'empty_rows', B=1, Hq=2, Hkv=1, Sq=7, Skv=4, D=3, Dv=5, causal=True)

    mask_rng = np.random.default_rng(17)
    allowed = mask_rng.random((2, 1, 6, 9)) > 0.3
    allowed[:, :, :, 0] = True       # every row keeps key 0 …
    allowed[1, 0, 2, :] = False      # … but this one: a fully masked row (zeros, lse −∞)
    core_case(arrays, 'allowed_padding', B=2, Hq=3, Hkv=3, Sq=6, Skv=9, D=4, Dv=4, key_lengths=[9, 5],
              allowed=allowed)
    core_case(arrays, 'bias', B=2, Hq=2, Hkv=1, Sq=6, Skv=8, D=6, Dv=3, bias_shape=(1, 2, 6, 8), bias_minus_inf=0.2)
    core_case(arrays, 'bias_key_row', B=2, Hq=4, Hkv=2, Sq=3, Skv=10, D=4, Dv=4, bias_shape=(2, 1, 1, 10),
              causal=True, top_left=True)
    core_case(arrays, 'softcap', B=1, Hq=3, Hkv=3, Sq=8, Skv=8, D=12, Dv=5, softcap=5.0, scale=1.5)
    core_case(arrays, 'alibi', B=2, Hq=4, Hkv=2, Sq=6, Skv=9, D=8, Dv=8, alibi=[0.5, 0.25, 0.125, 0.0625],
              causal=True, key_lengths=[9, 7])
    core_case(arrays, 'alibi_top_left', B=1, Hq=2, Hkv=2, Sq=7, Skv=5, D=4, Dv=6, alibi=[0.3, 0.7], top_left=True)
    core_case(arrays, 'sinks', B=2, Hq=4, Hkv=2, Sq=5, Skv=6, D=8, Dv=4, sinks=[0.5, -INF, 2.0, -1.25], causal=True)
    core_case(arrays, 'window_global', B=1, Hq=2, Hkv=1, Sq=12, Skv=12, D=6, Dv=6, window=(3, 1), global_tokens=2)
    core_case(arrays, 'scale_zero', B=1, Hq=2, Hkv=2, Sq=4, Skv=5, D=3, Dv=3, scale=0.0)
    core_case(arrays, 'varlen', B=1, Hq=4, Hkv=2, Sq=8, Skv=13, D=5, Dv=6, causal=True,
              cu_seqlens=([0, 3, 3, 8], [0, 4, 9, 13]))
    core_case(arrays, 'everything', B=2, Hq=6, Hkv=3, Sq=7, Skv=10, D=8, Dv=5, softcap=10.0, scale=0.4,
              bias_shape=(2, 6, 7, 10), bias_minus_inf=0.1, alibi=[0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625],
              sinks=[1.0, -0.5, 0.0, 2.5, -INF, 0.75], key_lengths=[10, 6], causal=True)

    module_case(arrays, 'module_self', E=12, Hq=3, Hkv=3, L=6, S=6, inputs=1, causal=True)
    module_case(arrays, 'module_gqa', E=24, Hq=6, Hkv=2, L=7, S=7, inputs=1, bias=False)
    module_case(arrays, 'module_cross_kv', E=12, Hq=4, Hkv=2, L=4, S=7, inputs=2)
    module_case(arrays, 'module_cross', E=12, Hq=4, Hkv=4, L=5, S=6, inputs=3, kdim=5, vdim=7)

    write_safetensors(args.output, arrays, {'generator': 'scripts/make_backward_fixtures.py',
                                            'torch': torch.__version__})
    print(f'wrote {args.output}: {len(arrays)} tensors, torch {torch.__version__}')


if __name__ == '__main__':
    main()
