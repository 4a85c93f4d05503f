"""The GGUF block formats the C++ GEMM kernels read: ggml type ids and their byte sizes."""

# ggml type ids of the block formats the kernel reads, and their bytes per 32-weight block
BLOCK_BYTES = {3: 20, 8: 34}  # Q4_1, Q8_0
# bytes per 32-column block of a packed group of 8 rows (QuantizedWeight.pack_a8): the same data, 8 rows
PACKED_BYTES = {3: 8 * 20, 8: 8 * 34}
QUANT_NAMES = {3: "Q4_1", 8: "Q8_0"}
Q4_1 = 3  # the format ops/csrc/amx_blocks.cpp reads
