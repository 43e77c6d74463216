/* The kernel-table ops both reference adapters (sim and opencl) implement, one row each:
   X(op name, kernel function). Each adapter defines the functions and its own FLOAT_DTYPES,
   then expands the list into its table, so the two tables cannot drift apart. */
#ifndef FLAGOS_BACKENDS_KERNEL_TABLE_H
#define FLAGOS_BACKENDS_KERNEL_TABLE_H

#define REFERENCE_KERNELS(X)                                  \
    X("aten::add.Tensor", add_tensor_kernel)                  \
    X("aten::sub.Tensor", sub_tensor_kernel)                  \
    X("aten::mul.Tensor", mul_tensor_kernel)                  \
    X("aten::div.Tensor", div_tensor_kernel)                  \
    X("aten::add.Scalar", add_scalar_kernel)                  \
    X("aten::sub.Scalar", sub_scalar_kernel)                  \
    X("aten::mul.Scalar", mul_scalar_kernel)                  \
    X("aten::div.Scalar", div_scalar_kernel)                  \
    X("aten::neg", neg_kernel)                                \
    X("aten::relu", relu_kernel)                              \
    X("aten::silu", silu_kernel)                              \
    X("aten::sigmoid", sigmoid_kernel)                        \
    X("aten::tanh", tanh_kernel)                              \
    X("aten::exp", exp_kernel)                                \
    X("aten::gelu", gelu_kernel)                              \
    X("aten::mm", mm_kernel)                                  \
    X("aten::bmm", bmm_kernel)                                \
    X("aten::addmm", addmm_kernel)                            \
    X("aten::sum.dim_IntList", sum_kernel)                    \
    X("aten::mean.dim", mean_kernel)                          \
    X("aten::_softmax", softmax_kernel)                       \
    X("aten::_safe_softmax", safe_softmax_kernel)             \
    X("aten::native_layer_norm", layer_norm_kernel)           \
    X("aten::convolution", convolution_kernel)                \
    X("aten::native_group_norm", group_norm_kernel)           \
    X("aten::upsample_nearest2d", upsample_nearest2d_kernel)  \
    X("aten::embedding", embedding_kernel)                    \
    X("aten::cat", cat_kernel)

#define KERNEL_TABLE_ROW(op, fn) {op, fn, FLOAT_DTYPES},

#endif
