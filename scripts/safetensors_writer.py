"""Writes safetensors files with NumPy alone (Debian has no Python safetensors package); the fixture generators use it.

The format, as model weights ship in it: an 8-byte little-endian unsigned header length N, N bytes of JSON
    {"<name>": {"dtype": "F64", "shape": [2, 3], "data_offsets": [begin, end]}, ..., "__metadata__": {"k": "v"}}
then the raw little-endian C-order data of every tensor, back to back; offsets count from the first data byte.
examples/safetensors.hpp reads it in C++.
"""
import json
import struct

import numpy as np

DTYPES = {np.dtype('<f8'): 'F64', np.dtype('<f4'): 'F32', np.dtype('<i8'): 'I64', np.dtype('<i4'): 'I32',
          np.dtype('u1'): 'U8', np.dtype('bool'): 'BOOL'}


def write_safetensors(path, arrays, metadata=None):
    """Writes `arrays` (name -> NumPy array, in that order) to `path`; `metadata` (str -> str) goes to __metadata__.
    The header is padded with spaces to a multiple of 8 bytes, as the reference writer does, so the data is aligned.
    The output depends only on the arguments."""
    header = {'__metadata__': dict(metadata)} if metadata else {}
    blobs, offset = [], 0
    for name, array in arrays.items():
        array = np.ascontiguousarray(array)
        array = array.astype(array.dtype.newbyteorder('<'))
        blob = array.tobytes(order='C')
        header[name] = {'dtype': DTYPES[array.dtype], 'shape': list(array.shape),
                        'data_offsets': [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(',', ':')).encode()
    text += b' ' * (-len(text) % 8)
    with open(path, 'wb') as f:
        f.write(struct.pack('<Q', len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)
