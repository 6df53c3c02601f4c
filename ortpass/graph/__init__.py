"""Plain onnx_ir helpers that know nothing of ortpass: name allocation, schema facts, sizes."""
