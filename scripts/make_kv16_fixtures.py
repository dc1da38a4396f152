#!/usr/bin/python3
"""Writes tests/fixtures/kv16_torch.safetensors: attention with keys and values rounded to 16 bits by PyTorch.

Run with Debian's interpreter, which has the packages (a pyenv `python3` first on PATH may not):

    apt-get install -y python3-torch python3-numpy     # PyTorch 1.13, NumPy 1.24 on Debian 12
    /usr/bin/python3 scripts/make_kv16_fixtures.py [--output tests/fixtures/kv16_torch.safetensors]

Issue 16 (16-bit keys and values): qkv::attention takes K and V stored as Eigen::half or Eigen::bfloat16 with a float
query, and must compute on the stored values converted exactly. Each case here draws q, k and v in float32, rounds k
and v with PyTorch (`k.half()` or `k.bfloat16()`: round to nearest even), widens the rounded values exactly to float64
(`k.half().double()`) and computes the attention in float64 with PyTorch's own math (scores, softmax, P·V, and
logsumexp for lse), so the expected values carry no float32 rounding. tests/test_kv16.cpp rebuilds the 16-bit K and V
from their stored bits, runs qkv on them and checks docs/design.md's accuracy rule against these outputs. The file is
safetensors (scripts/safetensors_writer.py; tests/fixtures/README.md). The output is deterministic (fixed seeds, single
thread).

Cases (names are the prefixes of the arrays, `<case>.<array>`), all with q [B, Hq, Sq, D], k [B, Hkv, Skv, D] and
v [B, Hkv, Skv, Dv] (BHSD); query head h reads kv head h // (Hq / Hkv) (GQA, PyTorch's repeat_interleave):
  half_gqa      float16, B 2, Hq 6, Hkv 2, Sq 7, Skv 45, D 37, Dv 21 (prefill: K and V packed)
  half_decode   float16, B 1, Hq 8, Hkv 2, Sq 1, Skv 100, D 60, Dv 64 (decoding: K and V read in place)
  half_long     float16, B 1, Hq 2, Hkv 1, Sq 40, Skv 2100, D 16, Dv 8 (one query tile past a 2048-key split-K chunk)
  bf16_causal   bfloat16, B 1, Hq 4, Hkv 1, Sq 19, Skv 19, D 33, Dv 17, causal (Sq = Skv: both alignments agree),
                scale 0.2
  bf16_decode   bfloat16, B 2, Hq 8, Hkv 2, Sq 2, Skv 70, D 64, Dv 45, key padding (key_lengths 70 and 51)

Tensor names per case: config (F64: B, Hq, Hkv, Sq, Skv, D, Dv, causal, scale, storage (0 = float16, 1 = bfloat16)),
q (F32), k_bits and v_bits (I16: the 16-bit patterns PyTorch stored, as int16), optional key_lengths (F64, [B]), and
the float64 outputs out [B, Hq, Sq, Dv] and lse [B, Hq, Sq] (natural log of each row's softmax denominator).

And `rounding.*`: float32 values (random over many binades, exact ties between two 16-bit neighbours, values at and
past float16's largest finite 65504, subnormals, ±0, ±inf, NaN) in `rounding.values` (F32), with PyTorch's
float16 and bfloat16 patterns in `rounding.half_bits` and `rounding.bf16_bits` (I16): the test checks that Eigen's
rounding (Eigen::half(x), Eigen::bfloat16(x)) gives the same bits, so that a K/V rounded in C++ is the K/V PyTorch
would store.
"""
import argparse
import math
import pathlib

import numpy as np
import torch

import safetensors_writer
from safetensors_writer import write_safetensors

# The 16-bit patterns are stored as I16, which examples/safetensors.hpp reads; the shared writer's table lists the
# dtypes the other fixtures use, so this one is registered here.
safetensors_writer.DTYPES.setdefault(np.dtype('<i2'), 'I16')

STORAGE = {'half': (torch.float16, 0), 'bf16': (torch.bfloat16, 1)}


def bits(t16):
    """The 16-bit patterns of a float16 or bfloat16 tensor, as int16 (same element size: a reinterpreting view)."""
    return t16.contiguous().view(torch.int16).numpy().astype('<i2')


def attention_case(arrays, case, *, storage, B, Hq, Hkv, Sq, Skv, D, Dv, causal=False, scale=None, key_lengths=None):
    torch.manual_seed(1600 + len(arrays))
    dtype, storage_code = STORAGE[storage]
    q = (2 * torch.randn(B, Hq, Sq, D)).float()
    k = (2 * torch.randn(B, Hkv, Skv, D)).float()
    v = torch.randn(B, Hkv, Skv, Dv).float()
    k16, v16 = k.to(dtype), v.to(dtype)            # round to nearest even
    kd, vd = k16.double(), v16.double()            # exactly: k.half().double() / k.bfloat16().double()
    group = Hq // Hkv
    kd = kd.repeat_interleave(group, dim=1)        # [B, Hq, Skv, D]: query head h reads kv head h // group
    vd = vd.repeat_interleave(group, dim=1)
    s = 1.0 / math.sqrt(D) if scale is None else scale
    scores = (q.double() @ kd.transpose(-2, -1)) * s  # q·k·scale, as qkv's semantics (docs/design.md)
    hidden = torch.zeros(B, 1, Sq, Skv, dtype=torch.bool)
    if causal:
        hidden |= torch.ones(Sq, Skv, dtype=torch.bool).triu(1)  # top-left diagonal (PyTorch's is_causal)
    if key_lengths is not None:
        for b, length in enumerate(key_lengths):
            hidden[b, :, :, length:] = True
    scores = scores.masked_fill(hidden, float('-inf'))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ vd
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    arrays[f'{case}.config'] = np.array([B, Hq, Hkv, Sq, Skv, D, Dv, int(causal), s, storage_code], dtype='<f8')
    arrays[f'{case}.q'] = q.numpy().astype('<f4')
    arrays[f'{case}.k_bits'] = bits(k16)
    arrays[f'{case}.v_bits'] = bits(v16)
    if key_lengths is not None:
        arrays[f'{case}.key_lengths'] = np.array(key_lengths, dtype='<f8')
    arrays[f'{case}.out'] = out.numpy().astype('<f8')
    arrays[f'{case}.lse'] = lse.numpy().astype('<f8')


def rounding_case(arrays):
    g = torch.Generator().manual_seed(1616)
    random = torch.randn(1024, generator=g) * torch.pow(2.0, torch.randint(-30, 30, (1024,), generator=g).float())
    # Exact ties halfway between two neighbours, at several exponents e and of both signs: from a value whose last
    # mantissa bit is even (1.25·2^e: round to even goes down) and from its odd neighbour (goes up); float16 keeps 10
    # mantissa bits (spacing 2^(e-10)), bfloat16 7 (spacing 2^(e-7)).
    ties = []
    for e in range(-14, 16, 3):
        base = 1.25 * 2.0 ** e
        for spacing in (2.0 ** (e - 10), 2.0 ** (e - 7)):
            for sign in (1.0, -1.0):
                ties += [sign * (base + spacing / 2), sign * (base + spacing + spacing / 2)]
    specials = [0.0, -0.0, 65504.0, -65504.0, 65519.99, 65520.0, -65520.0, 70000.0, -1e5, 1e38, 3.4e38, 1e-8, -6e-8,
                5.96e-8, 2.98e-8, 6.1e-5, 1e-40, float('inf'), float('-inf'), float('nan')]
    values = torch.cat([random, torch.tensor(ties, dtype=torch.float64).float(), torch.tensor(specials).float()])
    arrays['rounding.values'] = values.numpy().astype('<f4')
    arrays['rounding.half_bits'] = bits(values.half())
    arrays['rounding.bf16_bits'] = bits(values.bfloat16())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--output', default=str(pathlib.Path(__file__).resolve().parent.parent / 'tests' /
                                                'fixtures' / 'kv16_torch.safetensors'))
    args = parser.parse_args()
    torch.set_num_threads(1)
    arrays = {}
    attention_case(arrays, 'half_gqa', storage='half', B=2, Hq=6, Hkv=2, Sq=7, Skv=45, D=37, Dv=21)
    attention_case(arrays, 'half_decode', storage='half', B=1, Hq=8, Hkv=2, Sq=1, Skv=100, D=60, Dv=64)
    attention_case(arrays, 'half_long', storage='half', B=1, Hq=2, Hkv=1, Sq=40, Skv=2100, D=16, Dv=8)
    attention_case(arrays, 'bf16_causal', storage='bf16', B=1, Hq=4, Hkv=1, Sq=19, Skv=19, D=33, Dv=17, causal=True,
                   scale=0.2)
    attention_case(arrays, 'bf16_decode', storage='bf16', B=2, Hq=8, Hkv=2, Sq=2, Skv=70, D=64, Dv=45,
                   key_lengths=[70, 51])
    rounding_case(arrays)
    write_safetensors(args.output, arrays, {'generator': 'scripts/make_kv16_fixtures.py', 'torch': torch.__version__})
    print(f'wrote {args.output}: {len(arrays)} tensors, torch {torch.__version__}')


if __name__ == '__main__':
    main()
