"""The SparseAttention operator: schema, CPU reference, ONNX form, Triton kernels, TensorRT form."""
