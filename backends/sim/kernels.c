/* Kernels of the sim adapter: the op library of the emulated accelerator.
 *
 * Every kernel follows the calling convention in flagos/adapter.h. Elements are loaded to
 * float, computed in float (reductions, matmul, softmax and layer_norm accumulate in
 * double), and stored back in the tensor's dtype with round-to-nearest-even. Memory is
 * reached only through sim_resolve(), after checking that every element a tensor view
 * touches lies inside its buffer.
 */
#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_table.h"
#include "sim_internal.h"

#define FLOAT_DTYPES                                                                        \
    (FLAGOS_DTYPE_BIT(FLAGOS_FLOAT32) | FLAGOS_DTYPE_BIT(FLAGOS_FLOAT16) |                  \
     FLAGOS_DTYPE_BIT(FLAGOS_BFLOAT16))

enum {
    MAX_TENSORS = 3,      /* most inputs or outputs of one op (addmm, convolution, the norms) */
    MAX_OPERANDS = 4,     /* most tensors walked together by one iterator */
    MAX_SCALARS = 2,
    ANY_COUNT = -1        /* an op_signature count that accepts any number */
};

/* ---- dtype conversion ---------------------------------------------------- */

static uint32_t float_bits(float value)
{
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
}

static float bits_to_float(uint32_t bits)
{
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static float half_to_float(uint16_t half)
{
    uint32_t sign = (uint32_t)(half & 0x8000u) << 16;
    uint32_t exponent = (half >> 10) & 0x1fu;
    uint32_t mantissa = half & 0x3ffu;
    if (exponent == 0x1fu)
        return bits_to_float(sign | 0x7f800000u | (mantissa << 13));
    if (exponent == 0) {
        /* zero or subnormal: mantissa units of 2^-24, exact in float */
        float magnitude = ldexpf((float)mantissa, -24);
        return sign ? -magnitude : magnitude;
    }
    return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

/* value >> shift (0 < shift < 32), the dropped bits rounded to nearest, ties to even. */
static uint32_t shift_right_round_even(uint32_t value, uint32_t shift)
{
    uint32_t kept = value >> shift;
    uint32_t dropped = value & ((1u << shift) - 1u);
    uint32_t halfway = 1u << (shift - 1u);
    if (dropped > halfway || (dropped == halfway && (kept & 1u)))
        kept++;
    return kept;
}

static uint16_t float_to_half(float value)
{
    uint32_t bits = float_bits(value);
    uint32_t sign = (bits >> 16) & 0x8000u;
    uint32_t magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u)            /* NaN: the canonical quiet NaN, as PyTorch */
        return (uint16_t)(sign | 0x7e00u);
    if (magnitude >= 0x477ff000u)           /* rounds to 2^16 or more: infinity */
        return (uint16_t)(sign | 0x7c00u);
    if (magnitude >= 0x38800000u)           /* normal: round off 13 bits, rebias exponent */
        return (uint16_t)(sign | (shift_right_round_even(magnitude, 13) - (112u << 10)));
    if (magnitude < 0x33000000u)            /* below 2^-25, half the smallest subnormal: zero */
        return (uint16_t)sign;
    /* subnormal: count units of 2^-24 from the full 24-bit significand */
    uint32_t exponent = magnitude >> 23;
    uint32_t significand = (magnitude & 0x7fffffu) | 0x800000u;
    return (uint16_t)(sign | shift_right_round_even(significand, 126u - exponent));
}

static float bfloat16_to_float(uint16_t bf16)
{
    return bits_to_float((uint32_t)bf16 << 16);
}

static uint16_t float_to_bfloat16(float value)
{
    if (isnan(value))
        return 0x7fc0u;                     /* PyTorch's canonical bf16 NaN */
    uint32_t bits = float_bits(value);
    uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)((bits + rounding_bias) >> 16);
}

static int dtype_is_supported(int32_t dtype)
{
    return dtype >= 0 && dtype < FLAGOS_N_DTYPES && (FLOAT_DTYPES & FLAGOS_DTYPE_BIT(dtype));
}

static uint64_t dtype_size(int32_t dtype)
{
    return dtype == FLAGOS_INT64 ? 8u : dtype == FLAGOS_FLOAT32 ? 4u : 2u;
}

/* ---- tensor views -------------------------------------------------------- */

/* A validated flagos_tensor with the host memory behind its buffer. */
typedef struct tensor_view {
    unsigned char *data;                 /* start of the buffer; NULL when nothing is touched */
    int32_t dtype;
    int32_t ndim;                        /* -1: optional tensor absent */
    int64_t offset;
    int64_t numel;
    int64_t sizes[FLAGOS_MAX_DIMS];
    int64_t strides[FLAGOS_MAX_DIMS];
} tensor_view;

/* Element `index` counts from the start of the buffer; memcpy keeps unaligned buffers safe. */
static float load_element(const tensor_view *view, int64_t index)
{
    const unsigned char *at = view->data + (uint64_t)index * dtype_size(view->dtype);
    if (view->dtype == FLAGOS_FLOAT32) {
        float value;
        memcpy(&value, at, sizeof value);
        return value;
    }
    uint16_t raw;
    memcpy(&raw, at, sizeof raw);
    return view->dtype == FLAGOS_FLOAT16 ? half_to_float(raw) : bfloat16_to_float(raw);
}

static void store_element(const tensor_view *view, int64_t index, float value)
{
    unsigned char *at = view->data + (uint64_t)index * dtype_size(view->dtype);
    if (view->dtype == FLAGOS_FLOAT32) {
        memcpy(at, &value, sizeof value);
        return;
    }
    uint16_t raw = view->dtype == FLAGOS_FLOAT16 ? float_to_half(value) : float_to_bfloat16(value);
    memcpy(at, &raw, sizeof raw);
}

static int same_shape(const tensor_view *a, const tensor_view *b)
{
    if (a->ndim != b->ndim)
        return 0;
    for (int32_t d = 0; d < a->ndim; d++)
        if (a->sizes[d] != b->sizes[d])
            return 0;
    return 1;
}

/* Strides that walk `in` along `shape` (right-aligned broadcasting: missing or size-1
 * dims get stride 0). Returns 0 when `in` does not broadcast to `shape`. */
static int broadcast_strides(const tensor_view *in, int32_t ndim, const int64_t *shape,
                             int64_t *strides)
{
    if (in->ndim > ndim)
        return 0;
    int32_t lead = ndim - in->ndim;
    for (int32_t d = 0; d < ndim; d++) {
        strides[d] = 0;
        if (d < lead)
            continue;
        int64_t size = in->sizes[d - lead];
        if (size == shape[d])
            strides[d] = in->strides[d - lead];
        else if (size != 1)
            return 0;
    }
    return 1;
}

/* ---- checking and binding the arguments ---------------------------------- */

typedef struct op_signature {
    const char *op;
    int32_t n_inputs, n_outputs, n_scalars, n_ints;  /* n_ints may be ANY_COUNT */
    uint32_t optional_inputs;                        /* bit i: input i may be absent */
    uint32_t index_inputs;                           /* bit i: input i is int64 (indices) */
} op_signature;

static int32_t count_elements(const flagos_tensor *t, const char *op, const char *role,
                              int32_t index, int64_t *numel, flagos_status *status)
{
    /* the product of the non-zero sizes must fit too: kernels multiply subsets of them */
    int64_t count = 1;
    int empty = 0;
    for (int32_t d = 0; d < t->ndim; d++) {
        if (t->sizes[d] < 0 || t->strides[d] < 0)
            return sim_fail(status, SIM_ERROR_INVALID_VALUE,
                            "%s: %s %d has size %" PRId64 " and stride %" PRId64
                            " on dim %d (both must be >= 0)",
                            op, role, index, t->sizes[d], t->strides[d], d);
        if (t->sizes[d] == 0) {
            empty = 1;
            continue;
        }
        if (count > INT64_MAX / t->sizes[d])
            return sim_fail(status, SIM_ERROR_INVALID_VALUE,
                            "%s: %s %d has too many elements", op, role, index);
        count *= t->sizes[d];
    }
    *numel = empty ? 0 : count;
    return SIM_SUCCESS;
}

/* Highest element index a non-empty view touches; fails when it overflows int64. */
static int32_t last_element(const flagos_tensor *t, const char *op, const char *role,
                            int32_t index, int64_t *last, flagos_status *status)
{
    int64_t reach = t->offset;
    for (int32_t d = 0; d < t->ndim; d++) {
        if (t->sizes[d] <= 1 || t->strides[d] == 0)
            continue;
        int64_t extent = t->sizes[d] - 1;
        if (extent > (INT64_MAX - reach) / t->strides[d])
            return sim_fail(status, SIM_ERROR_OUT_OF_RANGE,
                            "%s: %s %d reaches past the largest element index", op, role,
                            index);
        reach += extent * t->strides[d];
    }
    *last = reach;
    return SIM_SUCCESS;
}

static int32_t bind_tensor(const flagos_kernel_args *args, const flagos_tensor *t,
                           const char *op, const char *role, int32_t index, tensor_view *view,
                           flagos_status *status)
{
    if (t->ndim < 0 || t->ndim > FLAGOS_MAX_DIMS)
        return sim_fail(status, SIM_ERROR_INVALID_VALUE, "%s: %s %d has ndim %d (0..%d)", op,
                        role, index, t->ndim, FLAGOS_MAX_DIMS);
    if (t->offset < 0)
        return sim_fail(status, SIM_ERROR_OUT_OF_RANGE, "%s: %s %d has offset %" PRId64, op,
                        role, index, t->offset);
    int64_t numel = 0;
    int32_t rc = count_elements(t, op, role, index, &numel, status);
    if (rc != SIM_SUCCESS)
        return rc;

    memset(view, 0, sizeof *view);
    view->dtype = t->dtype;
    view->ndim = t->ndim;
    view->offset = t->offset;
    view->numel = numel;
    memcpy(view->sizes, t->sizes, sizeof view->sizes);
    memcpy(view->strides, t->strides, sizeof view->strides);
    if (numel == 0)
        return SIM_SUCCESS;                /* touches no memory, so needs no buffer */

    int64_t last = 0;
    rc = last_element(t, op, role, index, &last, status);
    if (rc != SIM_SUCCESS)
        return rc;
    uint64_t nbytes = 0;
    void *host = sim_resolve(args->device, t->buffer, &nbytes, status);
    if (host == NULL)
        return status->code;
    uint64_t capacity = nbytes / dtype_size(t->dtype);
    if ((uint64_t)last >= capacity)
        return sim_fail(status, SIM_ERROR_OUT_OF_RANGE,
                        "%s: %s %d reaches element %" PRId64 " but its buffer holds %" PRIu64
                        " elements",
                        op, role, index, last, capacity);
    view->data = host;
    return SIM_SUCCESS;
}

static int32_t check_counts(const flagos_kernel_args *args, const op_signature *sig,
                            flagos_status *status)
{
    if (args == NULL || args->struct_size < sizeof(flagos_kernel_args))
        return sim_fail(status, SIM_ERROR_INVALID_VALUE, "%s: missing or truncated arguments",
                        sig->op);
    int ints_ok = sig->n_ints == ANY_COUNT ? args->n_ints >= 0 : args->n_ints == sig->n_ints;
    if (args->n_inputs != sig->n_inputs || args->n_outputs != sig->n_outputs ||
        args->n_scalars != sig->n_scalars || !ints_ok)
        return sim_fail(status, SIM_ERROR_INVALID_VALUE,
                        "%s: expected %d inputs, %d outputs, %d scalars and %s%d ints; got "
                        "%d, %d, %d and %d",
                        sig->op, sig->n_inputs, sig->n_outputs, sig->n_scalars,
                        sig->n_ints == ANY_COUNT ? "any " : "",
                        sig->n_ints == ANY_COUNT ? 0 : sig->n_ints, args->n_inputs,
                        args->n_outputs, args->n_scalars, args->n_ints);
    if ((sig->n_inputs > 0 && args->inputs == NULL) || args->outputs == NULL ||
        (sig->n_scalars > 0 && args->scalars == NULL) || (args->n_ints > 0 && args->ints == NULL))
        return sim_fail(status, SIM_ERROR_INVALID_VALUE, "%s: NULL argument array", sig->op);
    return SIM_SUCCESS;
}

static int32_t check_dtype(const flagos_tensor *t, int32_t dtype, const char *op,
                           const char *role, int32_t index, flagos_status *status)
{
    if (t->dtype != dtype)
        return sim_fail(status, SIM_ERROR_INVALID_VALUE,
                        "%s: %s %d has dtype %d but the call's dtype is %d", op, role, index,
                        t->dtype, dtype);
    return SIM_SUCCESS;
}

/* Checks the argument counts, that all tensors share one supported dtype (index inputs:
 * int64) and lie inside their buffers, and fills the views (absent optional inputs get ndim -1). */
static int32_t bind_args(const flagos_kernel_args *args, const op_signature *sig,
                         tensor_view *inputs, tensor_view *outputs, flagos_status *status)
{
    int32_t rc = check_counts(args, sig, status);
    if (rc != SIM_SUCCESS)
        return rc;
    int32_t dtype = args->outputs[0].dtype;
    if (!dtype_is_supported(dtype))
        return sim_fail(status, SIM_ERROR_NOT_SUPPORTED,
                        "%s: dtype %d is not supported (float32, float16, bfloat16 only)",
                        sig->op, dtype);
    for (int32_t i = 0; i < sig->n_inputs; i++) {
        const flagos_tensor *t = &args->inputs[i];
        if (t->ndim == -1 && (sig->optional_inputs & (1u << i))) {
            memset(&inputs[i], 0, sizeof inputs[i]);
            inputs[i].ndim = -1;
            continue;
        }
        int32_t want = (sig->index_inputs & (1u << i)) ? FLAGOS_INT64 : dtype;
        rc = check_dtype(t, want, sig->op, "input", i, status);
        if (rc == SIM_SUCCESS)
            rc = bind_tensor(args, t, sig->op, "input", i, &inputs[i], status);
        if (rc != SIM_SUCCESS)
            return rc;
    }
    for (int32_t i = 0; i < sig->n_outputs; i++) {
        rc = check_dtype(&args->outputs[i], dtype, sig->op, "output", i, status);
        if (rc == SIM_SUCCESS)
            rc = bind_tensor(args, &args->outputs[i], sig->op, "output", i, &outputs[i], status);
        if (rc != SIM_SUCCESS)
            return rc;
    }
    return SIM_SUCCESS;
}

static int32_t fail_shape(flagos_status *status, const char *op, const char *problem)
{
    return sim_fail(status, SIM_ERROR_INVALID_VALUE, "%s: %s", op, problem);
}

/* ---- strided N-d iteration ----------------------------------------------- */

/* Walks every index of `sizes` in row-major order, keeping one element index per operand.
 * Use: for (iter_start(...), iter_add(...); it.remaining > 0; iter_next(&it)). */
typedef struct nd_iter {
    int32_t ndim;
    int32_t n_operands;
    int64_t remaining;                   /* elements left, the current one included */
    int64_t sizes[FLAGOS_MAX_DIMS];
    int64_t counter[FLAGOS_MAX_DIMS];
    int64_t strides[MAX_OPERANDS][FLAGOS_MAX_DIMS];
    int64_t pos[MAX_OPERANDS];
} nd_iter;

static void iter_start(nd_iter *it, int32_t ndim, const int64_t *sizes)
{
    it->ndim = ndim;
    it->n_operands = 0;
    it->remaining = 1;
    for (int32_t d = 0; d < ndim; d++) {
        it->sizes[d] = sizes[d];
        it->counter[d] = 0;
        it->remaining *= sizes[d];
    }
}

/* Adds an operand starting at element `start`; returns its slot in it->pos. */
static int32_t iter_add(nd_iter *it, const int64_t *strides, int64_t start)
{
    int32_t k = it->n_operands++;
    for (int32_t d = 0; d < it->ndim; d++)
        it->strides[k][d] = it->sizes[d] > 1 ? strides[d] : 0;  /* size-1 dims never step */
    it->pos[k] = start;
    return k;
}

static void iter_next(nd_iter *it)
{
    if (--it->remaining <= 0)
        return;
    for (int32_t d = it->ndim - 1; d >= 0; d--) {
        if (++it->counter[d] < it->sizes[d]) {
            for (int32_t k = 0; k < it->n_operands; k++)
                it->pos[k] += it->strides[k][d];
            return;
        }
        /* carry: rewind this dim (never stepping past the last element) */
        it->counter[d] = 0;
        for (int32_t k = 0; k < it->n_operands; k++)
            it->pos[k] -= it->strides[k][d] * (it->sizes[d] - 1);
    }
}

/* ---- elementwise ops ----------------------------------------------------- */

/* One output element from the inputs' elements (b is 0 for unary ops) and the scalars. */
typedef float (*elementwise_fn)(float a, float b, const float *scalars);

static float add_tensor_fn(float a, float b, const float *s) { return a + s[0] * b; }
static float sub_tensor_fn(float a, float b, const float *s) { return a - s[0] * b; }
static float mul_tensor_fn(float a, float b, const float *s) { (void)s; return a * b; }
static float div_tensor_fn(float a, float b, const float *s) { (void)s; return a / b; }
static float add_scalar_fn(float a, float b, const float *s) { (void)b; return a + s[1] * s[0]; }
static float sub_scalar_fn(float a, float b, const float *s) { (void)b; return a - s[1] * s[0]; }
static float mul_scalar_fn(float a, float b, const float *s) { (void)b; return a * s[0]; }
static float div_scalar_fn(float a, float b, const float *s) { (void)b; return a / s[0]; }

static float neg_fn(float x, float b, const float *s)
{
    (void)b, (void)s;
    return -x;
}

static float relu_fn(float x, float b, const float *s)
{
    (void)b, (void)s;
    return x < 0.0f ? 0.0f : x;   /* NaN and -0.0 pass through, as in PyTorch */
}

static float sigmoid_fn(float x, float b, const float *s)
{
    (void)b, (void)s;
    return (float)(1.0 / (1.0 + exp(-(double)x)));
}

static float silu_fn(float x, float b, const float *s)
{
    (void)b, (void)s;
    return (float)((double)x / (1.0 + exp(-(double)x)));
}

static float tanh_fn(float x, float b, const float *s)
{
    (void)b, (void)s;
    return (float)tanh((double)x);
}

static float exp_fn(float x, float b, const float *s)
{
    (void)b, (void)s;
    return (float)exp((double)x);
}

static float gelu_erf_fn(float x, float b, const float *s)
{
    (void)b, (void)s;
    const double one_over_sqrt_2 = 0.70710678118654752440;
    double v = x;
    return (float)(0.5 * v * (1.0 + erf(v * one_over_sqrt_2)));
}

static float gelu_tanh_fn(float x, float b, const float *s)
{
    (void)b, (void)s;
    const double sqrt_2_over_pi = 0.79788456080286535588;
    double v = x;
    return (float)(0.5 * v * (1.0 + tanh(sqrt_2_over_pi * (v + 0.044715 * v * v * v))));
}

/* Whether a float32 view, with these strides over the output's dims, walks the output's shape
 * in row-major order and is aligned for float access: its element i is the output's element i. */
static int row_major_float32(const tensor_view *v, const int64_t *strides, const tensor_view *shape)
{
    if (v->dtype != FLAGOS_FLOAT32 ||
        ((uintptr_t)v->data + (uint64_t)v->offset * sizeof(float)) % _Alignof(float))
        return 0;
    int64_t expected = 1;
    for (int32_t d = shape->ndim - 1; d >= 0; d--) {
        if (shape->sizes[d] != 1 && strides[d] != expected)
            return 0;
        expected *= shape->sizes[d];
    }
    return 1;
}

/* out[i] = fn(in0[i], in1[i]) over the output's shape. A single input must have the
 * output's shape; two inputs broadcast to it. */
static int32_t map_elementwise(const op_signature *sig, const tensor_view *in,
                               const tensor_view *out, elementwise_fn fn,
                               const flagos_kernel_args *args, flagos_status *status)
{
    float scalars[MAX_SCALARS] = {0.0f, 0.0f};
    for (int32_t i = 0; i < sig->n_scalars && i < MAX_SCALARS; i++)
        scalars[i] = (float)args->scalars[i];

    int64_t in_strides[2][FLAGOS_MAX_DIMS];
    for (int32_t i = 0; i < sig->n_inputs; i++) {
        int fits = sig->n_inputs == 1 ? same_shape(&in[i], out)
                                      : broadcast_strides(&in[i], out->ndim, out->sizes,
                                                          in_strides[i]);
        if (!fits)
            return fail_shape(status, sig->op,
                              sig->n_inputs == 1 ? "input and output shapes differ"
                                                 : "an input does not broadcast to the output");
        if (sig->n_inputs == 1)
            memcpy(in_strides[i], in[i].strides, sizeof in_strides[i]);
    }

    if (row_major_float32(out, out->strides, out) && row_major_float32(&in[0], in_strides[0], out) &&
        (sig->n_inputs == 1 || row_major_float32(&in[1], in_strides[1], out))) {
        /* the common case: row-major float32 operands of the output's shape, one flat loop */
        float *o = (float *)(void *)(out->data + (uint64_t)out->offset * sizeof(float));
        const float *x = (const float *)(const void *)(in[0].data + (uint64_t)in[0].offset * sizeof(float));
        const float *y = sig->n_inputs > 1
                             ? (const float *)(const void *)(in[1].data + (uint64_t)in[1].offset * sizeof(float))
                             : NULL;
        for (int64_t i = 0; i < out->numel; i++)
            o[i] = fn(x[i], y != NULL ? y[i] : 0.0f, scalars);
        return sim_ok(status);
    }

    nd_iter it;
    iter_start(&it, out->ndim, out->sizes);
    int32_t o = iter_add(&it, out->strides, out->offset);
    int32_t a = iter_add(&it, in_strides[0], in[0].offset);
    int32_t b = sig->n_inputs > 1 ? iter_add(&it, in_strides[1], in[1].offset) : -1;
    for (; it.remaining > 0; iter_next(&it)) {
        float x = load_element(&in[0], it.pos[a]);
        float y = b >= 0 ? load_element(&in[1], it.pos[b]) : 0.0f;
        store_element(out, it.pos[o], fn(x, y, scalars));
    }
    return sim_ok(status);
}

static int32_t run_elementwise(const flagos_kernel_args *args, flagos_status *status,
                               const op_signature *sig, elementwise_fn fn)
{
    tensor_view in[MAX_TENSORS], out[MAX_TENSORS];
    int32_t rc = bind_args(args, sig, in, out, status);
    if (rc != SIM_SUCCESS)
        return rc;
    return map_elementwise(sig, in, &out[0], fn, args, status);
}

#define ELEMENTWISE_KERNEL(name, op_name, n_inputs, n_scalars, fn)                           \
    static int32_t name(const flagos_kernel_args *args, flagos_status *status)               \
    {                                                                                       \
        static const op_signature sig = {op_name, n_inputs, 1, n_scalars, 0, 0, 0};            \
        return run_elementwise(args, status, &sig, fn);                                     \
    }

ELEMENTWISE_KERNEL(add_tensor_kernel, "aten::add.Tensor", 2, 1, add_tensor_fn)
ELEMENTWISE_KERNEL(sub_tensor_kernel, "aten::sub.Tensor", 2, 1, sub_tensor_fn)
ELEMENTWISE_KERNEL(mul_tensor_kernel, "aten::mul.Tensor", 2, 0, mul_tensor_fn)
ELEMENTWISE_KERNEL(div_tensor_kernel, "aten::div.Tensor", 2, 0, div_tensor_fn)
ELEMENTWISE_KERNEL(add_scalar_kernel, "aten::add.Scalar", 1, 2, add_scalar_fn)
ELEMENTWISE_KERNEL(sub_scalar_kernel, "aten::sub.Scalar", 1, 2, sub_scalar_fn)
ELEMENTWISE_KERNEL(mul_scalar_kernel, "aten::mul.Scalar", 1, 1, mul_scalar_fn)
ELEMENTWISE_KERNEL(div_scalar_kernel, "aten::div.Scalar", 1, 1, div_scalar_fn)
ELEMENTWISE_KERNEL(neg_kernel, "aten::neg", 1, 0, neg_fn)
ELEMENTWISE_KERNEL(relu_kernel, "aten::relu", 1, 0, relu_fn)
ELEMENTWISE_KERNEL(silu_kernel, "aten::silu", 1, 0, silu_fn)
ELEMENTWISE_KERNEL(sigmoid_kernel, "aten::sigmoid", 1, 0, sigmoid_fn)
ELEMENTWISE_KERNEL(tanh_kernel, "aten::tanh", 1, 0, tanh_fn)
ELEMENTWISE_KERNEL(exp_kernel, "aten::exp", 1, 0, exp_fn)

static int32_t gelu_kernel(const flagos_kernel_args *args, flagos_status *status)
{
    static const op_signature sig = {"aten::gelu", 1, 1, 0, 1, 0, 0};
    tensor_view in[MAX_TENSORS], out[MAX_TENSORS];
    int32_t rc = bind_args(args, &sig, in, out, status);
    if (rc != SIM_SUCCESS)
        return rc;
    int64_t approximate = args->ints[0];
    if (approximate != 0 && approximate != 1)
        return sim_fail(status, SIM_ERROR_INVALID_VALUE,
                        "aten::gelu: approximate is %" PRId64 " (0 none, 1 tanh)", approximate);
    return map_elementwise(&sig, in, &out[0], approximate ? gelu_tanh_fn : gelu_erf_fn, args,
                           status);
}

/* ---- matrix products ----------------------------------------------------- */

/* A 2-d slice of a 2-d or 3-d view: element (i, j) is base + i*row_stride + j*col_stride. */
typedef struct matrix {
    const tensor_view *view;
    int64_t base;
    int64_t row_stride;
    int64_t col_stride;
} matrix;

static matrix matrix_at_batch(const tensor_view *view, int64_t batch)
{
    int32_t rows_dim = view->ndim - 2;
    matrix m = {view, view->offset, view->strides[rows_dim], view->strides[rows_dim + 1]};
    if (view->ndim == 3)
        m.base += batch * view->strides[0];
    return m;
}

static float matrix_load(const matrix *m, int64_t row, int64_t col)
{
    return load_element(m->view, m->base + row * m->row_stride + col * m->col_stride);
}

/* The product is formed block by block: operands are converted once per block (not once per
 * multiply-add), to double, and each output element accumulates in double over k in ascending
 * order. A float times a float is exact in double, so the result does not depend on how the
 * loop below is vectorized or whether its multiply-add is fused. Blocks live on the stack (about
 * 96 KiB). */
enum { GEMM_ROWS = 64, GEMM_COLS = 64, GEMM_DEPTH = 64, TILE_ROWS = 4, TILE_COLS = 8 };

typedef struct gemm_block {
    int64_t row0, rows;                  /* output rows [row0, row0 + rows) */
    int64_t col0, cols;                  /* output cols [col0, col0 + cols) */
    double acc[GEMM_ROWS][GEMM_COLS];    /* the block of a@b */
} gemm_block;

static int64_t min_i64(int64_t a, int64_t b)
{
    return a < b ? a : b;
}

/* dst[r][c] = m[row0 + r][col0 + c] as double for r < rows, c < cols, and 0 up to pad_rows x
 * pad_cols (rows and columns no output reads), `ld` doubles per dst row. */
static void pack_doubles(const matrix *m, int64_t row0, int64_t rows, int64_t col0, int64_t cols,
                         int64_t pad_rows, int64_t pad_cols, double *dst, int64_t ld)
{
    for (int64_t r = 0; r < pad_rows; r++) {
        int64_t c = 0;
        if (r < rows && m->view->dtype == FLAGOS_FLOAT32) { /* the common case, without the dtype test */
            const unsigned char *row = m->view->data +
                                       (uint64_t)(m->base + (row0 + r) * m->row_stride) * sizeof(float);
            for (; c < cols; c++) {
                float value;
                memcpy(&value, row + (uint64_t)((col0 + c) * m->col_stride) * sizeof(float), sizeof value);
                dst[r * ld + c] = value;
            }
        }
        for (; c < pad_cols; c++)
            dst[r * ld + c] = r < rows && c < cols ? (double)matrix_load(m, row0 + r, col0 + c) : 0.0;
    }
}

/* On x86-64 a second copy of the tile loop is compiled for AVX2 machines and picked at load time
 * (the same arithmetic, four doubles an instruction instead of two). */
#if defined(__x86_64__) && defined(__GNUC__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define SIM_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef SIM_VECTOR_CLONES
#define SIM_VECTOR_CLONES
#endif

/* acc[TILE_ROWS][TILE_COLS] (row stride GEMM_COLS) += a[TILE_ROWS][depth] (row stride
 * GEMM_DEPTH) @ b[depth][TILE_COLS] (row stride GEMM_COLS), the tile in registers over k. With
 * GCC's vector types each row of the tile is two vectors of four doubles (one AVX register each,
 * or two SSE2 registers): a row of b is loaded once per k and every a[i][k] is broadcast to it. */
#if defined(__GNUC__)
typedef double double4 __attribute__((vector_size(32)));

SIM_VECTOR_CLONES
static void accumulate_tile(const double *a, const double *b, int64_t depth, double *acc)
{
    double4 t[TILE_ROWS][2];
    for (int i = 0; i < TILE_ROWS; i++) {
        memcpy(&t[i][0], acc + i * GEMM_COLS, sizeof(double4));
        memcpy(&t[i][1], acc + i * GEMM_COLS + 4, sizeof(double4));
    }
    for (int64_t k = 0; k < depth; k++) {
        double4 b0, b1;
        memcpy(&b0, b + k * GEMM_COLS, sizeof b0);
        memcpy(&b1, b + k * GEMM_COLS + 4, sizeof b1);
        for (int i = 0; i < TILE_ROWS; i++) {
            double x = a[i * GEMM_DEPTH + k];
            t[i][0] += x * b0;
            t[i][1] += x * b1;
        }
    }
    for (int i = 0; i < TILE_ROWS; i++) {
        memcpy(acc + i * GEMM_COLS, &t[i][0], sizeof(double4));
        memcpy(acc + i * GEMM_COLS + 4, &t[i][1], sizeof(double4));
    }
}
#else
static void accumulate_tile(const double *a, const double *b, int64_t depth, double *acc)
{
    for (int64_t k = 0; k < depth; k++)
        for (int i = 0; i < TILE_ROWS; i++)
            for (int j = 0; j < TILE_COLS; j++)
                acc[i * GEMM_COLS + j] += a[i * GEMM_DEPTH + k] * b[k * GEMM_COLS + j];
}
#endif

/* block->acc += a[rows, k0:k0+depth] @ b[k0:k0+depth, cols], tile by tile (the block's rows
 * and columns padded to whole tiles with zeros: the padding's sums are never stored). */
static void accumulate_depth_slice(const matrix *a, const matrix *b, int64_t k0, int64_t depth,
                                   gemm_block *block)
{
    double a_pack[GEMM_ROWS][GEMM_DEPTH];
    double b_pack[GEMM_DEPTH][GEMM_COLS];
    int64_t rows = (block->rows + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
    int64_t cols = (block->cols + TILE_COLS - 1) / TILE_COLS * TILE_COLS;
    pack_doubles(a, block->row0, block->rows, k0, depth, rows, depth, &a_pack[0][0], GEMM_DEPTH);
    pack_doubles(b, k0, depth, block->col0, block->cols, depth, cols, &b_pack[0][0], GEMM_COLS);
    for (int64_t r = 0; r < rows; r += TILE_ROWS)
        for (int64_t c = 0; c < cols; c += TILE_COLS)
            accumulate_tile(&a_pack[r][0], &b_pack[0][c], depth, &block->acc[r][c]);
}

/* out = alpha * a@b + beta * c over one block. As in BLAS, c is not read when beta is 0
 * and a@b is not formed when alpha is 0, so NaNs there do not leak into the result. */
static void gemm_block_run(const matrix *a, const matrix *b, const matrix *c, double alpha,
                           double beta, const matrix *out, int64_t depth, gemm_block *block)
{
    memset(block->acc, 0, sizeof block->acc);
    for (int64_t k0 = 0; alpha != 0.0 && k0 < depth; k0 += GEMM_DEPTH)
        accumulate_depth_slice(a, b, k0, min_i64(GEMM_DEPTH, depth - k0), block);
    for (int64_t r = 0; r < block->rows; r++) {
        for (int64_t col = 0; col < block->cols; col++) {
            int64_t i = block->row0 + r, j = block->col0 + col;
            double value = alpha != 0.0 ? alpha * block->acc[r][col] : 0.0;
            if (c != NULL && beta != 0.0)
                value += beta * (double)matrix_load(c, i, j);
            store_element(out->view, out->base + i * out->row_stride + j * out->col_stride,
                          (float)value);
        }
    }
}

/* out = alpha * a@b + beta * c for a [rows, depth] and b [depth, cols]. */
static void gemm(const matrix *a, const matrix *b, const matrix *c, double alpha, double beta,
                 const matrix *out, int64_t rows, int64_t cols, int64_t depth)
{
    gemm_block block;
    for (block.row0 = 0; block.row0 < rows; block.row0 += GEMM_ROWS) {
        block.rows = min_i64(GEMM_ROWS, rows - block.row0);
        for (block.col0 = 0; block.col0 < cols; block.col0 += GEMM_COLS) {
            block.cols = min_i64(GEMM_COLS, cols - block.col0);
            gemm_block_run(a, b, c, alpha, beta, out, depth, &block);
        }
    }
}

/* Checks a [.., M, K] @ [.., K, N] -> [.., M, N] with matching batch dims (3-d only). */
static int32_t check_matmul_shapes(const char *op, int32_t ndim, const tensor_view *a,
                                   const tensor_view *b, const tensor_view *out,
                                   flagos_status *status)
{
    if (a->ndim != ndim || b->ndim != ndim || out->ndim != ndim)
        return sim_fail(status, SIM_ERROR_INVALID_VALUE,
                        "%s: expected %d-d operands, got %d-d @ %d-d -> %d-d", op, ndim,
                        a->ndim, b->ndim, out->ndim);
    int32_t r = ndim - 2;
    if (ndim == 3 && (a->sizes[0] != b->sizes[0] || a->sizes[0] != out->sizes[0]))
        return fail_shape(status, op, "batch sizes differ");
    if (a->sizes[r + 1] != b->sizes[r])
        return sim_fail(status, SIM_ERROR_INVALID_VALUE,
                        "%s: inner dims differ (%" PRId64 " vs %" PRId64 ")", op,
                        a->sizes[r + 1], b->sizes[r]);
    if (out->sizes[r] != a->sizes[r] || out->sizes[r + 1] != b->sizes[r + 1])
        return fail_shape(status, op, "output shape is not [M, N]");
    return SIM_SUCCESS;
}

static int32_t run_matmul(const flagos_kernel_args *args, flagos_status *status,
                          const op_signature *sig, int32_t ndim)
{
    tensor_view in[MAX_TENSORS], out[MAX_TENSORS];
    int32_t rc = bind_args(args, sig, in, out, status);
    if (rc == SIM_SUCCESS)
        rc = check_matmul_shapes(sig->op, ndim, &in[0], &in[1], &out[0], status);
    if (rc != SIM_SUCCESS)
        return rc;
    int32_t r = ndim - 2;
    int64_t batches = ndim == 3 ? out[0].sizes[0] : 1;
    for (int64_t batch = 0; batch < batches; batch++) {
        matrix a = matrix_at_batch(&in[0], batch);
        matrix b = matrix_at_batch(&in[1], batch);
        matrix c = matrix_at_batch(&out[0], batch);
        gemm(&a, &b, NULL, 1.0, 0.0, &c, out[0].sizes[r], out[0].sizes[r + 1],
             in[0].sizes[r + 1]);
    }
    return sim_ok(status);
}

static int32_t mm_kernel(const flagos_kernel_args *args, flagos_status *status)
{
    static const op_signature sig = {"aten::mm", 2, 1, 0, 0, 0, 0};
    return run_matmul(args, status, &sig, 2);
}

static int32_t bmm_kernel(const flagos_kernel_args *args, flagos_status *status)
{
    static const op_signature sig = {"aten::bmm", 2, 1, 0, 0, 0, 0};
    return run_matmul(args, status, &sig, 3);
}

static int32_t addmm_kernel(const flagos_kernel_args *args, flagos_status *status)
{
    static const op_signature sig = {"aten::addmm", 3, 1, 2, 0, 0, 0};
    tensor_view in[MAX_TENSORS], out[MAX_TENSORS];
    int32_t rc = bind_args(args, &sig, in, out, status);
    if (rc == SIM_SUCCESS)
        rc = check_matmul_shapes(sig.op, 2, &in[1], &in[2], &out[0], status);
    if (rc != SIM_SUCCESS)
        return rc;
    int64_t self_strides[2];
    if (!broadcast_strides(&in[0], 2, out[0].sizes, self_strides))
        return fail_shape(status, sig.op, "self does not broadcast to [M, N]");
    matrix self = {&in[0], in[0].offset, self_strides[0], self_strides[1]};
    matrix a = matrix_at_batch(&in[1], 0);
    matrix b = matrix_at_batch(&in[2], 0);
    matrix c = matrix_at_batch(&out[0], 0);
    gemm(&a, &b, &self, args->scalars[1], args->scalars[0], &c, out[0].sizes[0],
         out[0].sizes[1], in[1].sizes[1]);
    return sim_ok(status);
}

/* ---- reductions ---------------------------------------------------------- */

/* Marks the reduced dims from `dims` (ascending, non-negative; none means all dims).
 * A 0-d tensor accepts dim 0, as PyTorch does. */
static int32_t parse_reduced_dims(const char *op, const int64_t *dims, int32_t n_dims,
                                  int32_t ndim, int *reduced, flagos_status *status)
{
    for (int32_t d = 0; d < FLAGOS_MAX_DIMS; d++)
        reduced[d] = n_dims == 0 && d < ndim;
    int64_t limit = ndim > 0 ? ndim : 1;
    for (int32_t i = 0; i < n_dims; i++) {
        if (dims[i] < 0 || dims[i] >= limit)
            return sim_fail(status, SIM_ERROR_INVALID_VALUE,
                            "%s: dim %" PRId64 " out of range for a %d-d tensor", op, dims[i],
                            ndim);
        if (i > 0 && dims[i] <= dims[i - 1])
            return fail_shape(status, op, "reduced dims are not strictly ascending");
        if (ndim > 0)
            reduced[dims[i]] = 1;
    }
    return SIM_SUCCESS;
}

static double sum_over(const tensor_view *in, const int64_t *reduced_sizes, int64_t start)
{
    nd_iter it;
    iter_start(&it, in->ndim, reduced_sizes);
    int32_t x = iter_add(&it, in->strides, start);
    double sum = 0.0;
    for (; it.remaining > 0; iter_next(&it))
        sum += (double)load_element(in, it.pos[x]);
    return sum;
}

static int32_t run_reduction(const flagos_kernel_args *args, flagos_status *status,
                             const op_signature *sig, int take_mean)
{
    tensor_view in[MAX_TENSORS], out[MAX_TENSORS];
    int reduced[FLAGOS_MAX_DIMS];
    int32_t rc = bind_args(args, sig, in, out, status);
    if (rc == SIM_SUCCESS)
        rc = parse_reduced_dims(sig->op, args->ints, args->n_ints, in[0].ndim, reduced, status);
    if (rc != SIM_SUCCESS)
        return rc;

    int64_t kept_sizes[FLAGOS_MAX_DIMS], reduced_sizes[FLAGOS_MAX_DIMS];
    int64_t count = 1;
    for (int32_t d = 0; d < in[0].ndim; d++) {
        kept_sizes[d] = reduced[d] ? 1 : in[0].sizes[d];
        reduced_sizes[d] = reduced[d] ? in[0].sizes[d] : 1;
        count *= reduced_sizes[d];
    }
    tensor_view expected = in[0];
    memcpy(expected.sizes, kept_sizes, sizeof(int64_t) * (size_t)in[0].ndim);
    if (!same_shape(&expected, &out[0]))
        return fail_shape(status, sig->op, "output is not the keepdim shape of the reduction");

    nd_iter it;
    iter_start(&it, in[0].ndim, kept_sizes);
    int32_t x = iter_add(&it, in[0].strides, in[0].offset);
    int32_t o = iter_add(&it, out[0].strides, out[0].offset);
    for (; it.remaining > 0; iter_next(&it)) {
        double sum = sum_over(&in[0], reduced_sizes, it.pos[x]);
        double value = !take_mean ? sum : count > 0 ? sum / (double)count : NAN;
        store_element(&out[0], it.pos[o], (float)value);
    }
    return sim_ok(status);
}

static int32_t sum_kernel(const flagos_kernel_args *args, flagos_status *status)
{
    static const op_signature sig = {"aten::sum.dim_IntList", 1, 1, 0, ANY_COUNT, 0, 0};
    return run_reduction(args, status, &sig, 0);
}

static int32_t mean_kernel(const flagos_kernel_args *args, flagos_status *status)
{
    static const op_signature sig = {"aten::mean.dim", 1, 1, 0, ANY_COUNT, 0, 0};
    return run_reduction(args, status, &sig, 1);
}

/* ---- softmax ------------------------------------------------------------- */

/* Softmax of one row of `length` elements `stride` apart; subtracting the row's max keeps
 * exp() from overflowing. `safe` (_safe_softmax): a row of -inf only is zeros, not NaN. */
static void softmax_row(const tensor_view *in, int64_t in_start, const tensor_view *out,
                        int64_t out_start, int64_t length, int64_t in_stride, int64_t out_stride,
                        int safe)
{
    float max = -INFINITY;
    for (int64_t k = 0; k < length; k++) {
        float x = load_element(in, in_start + k * in_stride);
        if (x > max || isnan(x))
            max = x;
        if (isnan(max))
            break;
    }
    if (safe && max == -INFINITY) { /* every element -inf (a fully masked attention row) */
        for (int64_t k = 0; k < length; k++)
            store_element(out, out_start + k * out_stride, 0.0f);
        return;
    }
    /* each exp once where the row fits on the stack (an attention row of up to 4096 keys) */
    enum { KEPT_EXPS = 4096 };
    double exps[KEPT_EXPS];
    int kept = length <= KEPT_EXPS;
    double sum = 0.0;
    for (int64_t k = 0; k < length; k++) {
        double e = exp((double)load_element(in, in_start + k * in_stride) - (double)max);
        if (kept)
            exps[k] = e;
        sum += e;
    }
    for (int64_t k = 0; k < length; k++) {
        double e = kept ? exps[k] : exp((double)load_element(in, in_start + k * in_stride) - (double)max);
        store_element(out, out_start + k * out_stride, (float)(e / sum));
    }
}

static int32_t run_softmax(const flagos_kernel_args *args, flagos_status *status,
                           const op_signature *signature, int safe)
{
    const op_signature sig = *signature;
    tensor_view in[MAX_TENSORS], out[MAX_TENSORS];
    int32_t rc = bind_args(args, &sig, in, out, status);
    if (rc != SIM_SUCCESS)
        return rc;
    int64_t dim = args->ints[0];
    int32_t ndim = in[0].ndim;
    if (dim < 0 || dim >= (ndim > 0 ? ndim : 1))
        return sim_fail(status, SIM_ERROR_INVALID_VALUE,
                        "%s: dim %" PRId64 " out of range for a %d-d tensor", sig.op, dim,
                        ndim);
    if (!same_shape(&in[0], &out[0]))
        return fail_shape(status, sig.op, "input and output shapes differ");

    /* a 0-d tensor is one row of one element */
    int64_t length = ndim > 0 ? in[0].sizes[dim] : 1;
    int64_t in_stride = ndim > 0 ? in[0].strides[dim] : 0;
    int64_t out_stride = ndim > 0 ? out[0].strides[dim] : 0;
    int64_t row_sizes[FLAGOS_MAX_DIMS];
    memcpy(row_sizes, in[0].sizes, sizeof row_sizes);
    if (ndim > 0)
        row_sizes[dim] = 1;

    nd_iter it;
    iter_start(&it, ndim, row_sizes);
    int32_t x = iter_add(&it, in[0].strides, in[0].offset);
    int32_t o = iter_add(&it, out[0].strides, out[0].offset);
    for (; it.remaining > 0; iter_next(&it))
        softmax_row(&in[0], it.pos[x], &out[0], it.pos[o], length, in_stride, out_stride, safe);
    return sim_ok(status);
}

static int32_t softmax_kernel(const flagos_kernel_args *args, flagos_status *status)
{
    static const op_signature sig = {"aten::_softmax", 1, 1, 0, 1, 0, 0};
    return run_softmax(args, status, &sig, 0);
}

static int32_t safe_softmax_kernel(const flagos_kernel_args *args, flagos_status *status)
{
    static const op_signature sig = {"aten::_safe_softmax", 1, 1, 0, 1, 0, 0};
    return run_softmax(args, status, &sig, 1);
}

/* ---- layer norm ---------------------------------------------------------- */

typedef struct layer_norm_shape {
    int32_t ndim;
    int32_t axis;                          /* first normalized dim */
    int64_t row_sizes[FLAGOS_MAX_DIMS];    /* leading dims, normalized dims 1 */
    int64_t norm_sizes[FLAGOS_MAX_DIMS];   /* leading dims 1, normalized dims */
    int64_t weight_strides[FLAGOS_MAX_DIMS];
    int64_t bias_strides[FLAGOS_MAX_DIMS];
    int64_t row_length;
} layer_norm_shape;

/* An affine parameter (weight or bias) has exactly the normalized shape; its strides are
 * spread over the input's dims with 0 on the leading ones. */
static int32_t place_affine_param(const tensor_view *param, const tensor_view *input,
                                  int32_t axis, const char *name, int64_t *strides,
                                  flagos_status *status)
{
    memset(strides, 0, sizeof(int64_t) * FLAGOS_MAX_DIMS);
    if (param->ndim == -1)
        return SIM_SUCCESS;
    int fits = param->ndim == input->ndim - axis;
    for (int32_t d = 0; fits && d < param->ndim; d++)
        fits = param->sizes[d] == input->sizes[axis + d];
    if (!fits)
        return sim_fail(status, SIM_ERROR_INVALID_VALUE,
                        "aten::native_layer_norm: %s is not of the normalized shape", name);
    for (int32_t d = 0; d < param->ndim; d++)
        strides[axis + d] = param->strides[d];
    return SIM_SUCCESS;
}

static int32_t check_layer_norm(const flagos_kernel_args *args, const tensor_view *in,
                                const tensor_view *out, layer_norm_shape *shape,
                                flagos_status *status)
{
    const char *op = "aten::native_layer_norm";
    int32_t ndim = in[0].ndim;
    int64_t n_normalized = args->ints[0];
    if (n_normalized < 1 || n_normalized > ndim)
        return sim_fail(status, SIM_ERROR_INVALID_VALUE,
                        "%s: %" PRId64 " normalized dims for a %d-d input (1..ndim)", op,
                        n_normalized, ndim);
    shape->ndim = ndim;
    shape->axis = ndim - (int32_t)n_normalized;
    shape->row_length = 1;
    for (int32_t d = 0; d < ndim; d++) {
        int normalized = d >= shape->axis;
        shape->row_sizes[d] = normalized ? 1 : in[0].sizes[d];
        shape->norm_sizes[d] = normalized ? in[0].sizes[d] : 1;
        shape->row_length *= shape->norm_sizes[d];
    }
    int32_t rc = place_affine_param(&in[1], &in[0], shape->axis, "weight",
                                    shape->weight_strides, status);
    if (rc == SIM_SUCCESS)
        rc = place_affine_param(&in[2], &in[0], shape->axis, "bias", shape->bias_strides,
                                status);
    if (rc != SIM_SUCCESS)
        return rc;
    if (!same_shape(&in[0], &out[0]))
        return fail_shape(status, op, "output shape differs from the input's");
    tensor_view stats = in[0];
    memcpy(stats.sizes, shape->row_sizes, sizeof stats.sizes);
    if (!same_shape(&stats, &out[1]) || !same_shape(&stats, &out[2]))
        return fail_shape(status, op, "mean or rstd is not [leading dims, 1, ...]");
    return SIM_SUCCESS;
}

/* Mean and biased variance of one row, two-pass in double for accuracy. An empty row
 * gets mean 0 and variance NaN, as PyTorch gives. */
static void row_moments(const tensor_view *in, const layer_norm_shape *shape, int64_t start,
                        double *mean, double *variance)
{
    double sum = sum_over(in, shape->norm_sizes, start);
    double n = (double)shape->row_length;
    *mean = shape->row_length > 0 ? sum / n : 0.0;

    nd_iter it;
    iter_start(&it, shape->ndim, shape->norm_sizes);
    int32_t x = iter_add(&it, in->strides, start);
    double squares = 0.0;
    for (; it.remaining > 0; iter_next(&it)) {
        double deviation = (double)load_element(in, it.pos[x]) - *mean;
        squares += deviation * deviation;
    }
    *variance = shape->row_length > 0 ? squares / n : NAN;
}

/* output = (x - mean) * rstd * weight + bias over one row. */
static void normalize_row(const tensor_view *in, const tensor_view *out,
                          const layer_norm_shape *shape, int64_t in_start, int64_t out_start,
                          double mean, double rstd)
{
    const tensor_view *weight = in + 1, *bias = in + 2;
    nd_iter it;
    iter_start(&it, shape->ndim, shape->norm_sizes);
    int32_t x = iter_add(&it, in->strides, in_start);
    int32_t y = iter_add(&it, out->strides, out_start);
    int32_t w = iter_add(&it, shape->weight_strides, weight->offset);
    int32_t b = iter_add(&it, shape->bias_strides, bias->offset);
    for (; it.remaining > 0; iter_next(&it)) {
        double value = ((double)load_element(in, it.pos[x]) - mean) * rstd;
        if (weight->ndim != -1)
            value *= (double)load_element(weight, it.pos[w]);
        if (bias->ndim != -1)
            value += (double)load_element(bias, it.pos[b]);
        store_element(out, it.pos[y], (float)value);
    }
}

static int32_t layer_norm_kernel(const flagos_kernel_args *args, flagos_status *status)
{
    static const op_signature sig = {"aten::native_layer_norm", 3, 3, 1, 1, 0x6u, 0};
    tensor_view in[MAX_TENSORS], out[MAX_TENSORS];
    layer_norm_shape shape;
    int32_t rc = bind_args(args, &sig, in, out, status);
    if (rc == SIM_SUCCESS)
        rc = check_layer_norm(args, in, out, &shape, status);
    if (rc != SIM_SUCCESS)
        return rc;
    double eps = args->scalars[0];

    nd_iter it;
    iter_start(&it, shape.ndim, shape.row_sizes);
    int32_t x = iter_add(&it, in[0].strides, in[0].offset);
    int32_t y = iter_add(&it, out[0].strides, out[0].offset);
    int32_t m = iter_add(&it, out[1].strides, out[1].offset);
    int32_t r = iter_add(&it, out[2].strides, out[2].offset);
    for (; it.remaining > 0; iter_next(&it)) {
        double mean, variance;
        row_moments(&in[0], &shape, it.pos[x], &mean, &variance);
        double rstd = 1.0 / sqrt(variance + eps);
        normalize_row(&in[0], &out[0], &shape, it.pos[x], it.pos[y], mean, rstd);
        store_element(&out[1], it.pos[m], (float)mean);
        store_element(&out[2], it.pos[r], (float)rstd);
    }
    return sim_ok(status);
}

/* ---- convolution --------------------------------------------------------- */

/* A float32 scratch matrix of the host's memory, for gemm(). */
static tensor_view scratch_view(float *data)
{
    tensor_view v;
    memset(&v, 0, sizeof v);
    v.data = (unsigned char *)data;
    v.dtype = FLAGOS_FLOAT32;
    v.ndim = 2;
    return v;
}

typedef struct conv_shape {
    int64_t n, cin, h, w, cout, kh, kw, oh, ow, groups;
    int64_t stride[2], pad[2], dilation[2];
} conv_shape;

static int32_t check_convolution(const flagos_kernel_args *args, const tensor_view *in,
                                 const tensor_view *out, conv_shape *c, flagos_status *status)
{
    const char *op = "aten::convolution";
    if (in[0].ndim != 4 || in[1].ndim != 4 || out[0].ndim != 4)
        return fail_shape(status, op, "input, weight and output must be 4-d");
    const int64_t *v = args->ints;
    for (int i = 0; i < 7; i++)
        if ((i == 2 || i == 3) ? v[i] < 0 : v[i] < 1)
            return fail_shape(status, op, "stride, dilation and groups must be >= 1, padding >= 0");
    c->n = in[0].sizes[0], c->cin = in[0].sizes[1], c->h = in[0].sizes[2], c->w = in[0].sizes[3];
    c->cout = in[1].sizes[0], c->kh = in[1].sizes[2], c->kw = in[1].sizes[3];
    c->stride[0] = v[0], c->stride[1] = v[1], c->pad[0] = v[2], c->pad[1] = v[3];
    c->dilation[0] = v[4], c->dilation[1] = v[5], c->groups = v[6];
    if (c->cin != in[1].sizes[1] * c->groups || c->cout % c->groups != 0)
        return fail_shape(status, op, "channels do not divide into groups as the weight says");
    if (in[2].ndim != -1 && (in[2].ndim != 1 || in[2].sizes[0] != c->cout))
        return fail_shape(status, op, "bias is not [Cout]");
    if (c->kh > (INT64_MAX / 4) / c->dilation[0] || c->kw > (INT64_MAX / 4) / c->dilation[1] ||
        c->pad[0] > INT64_MAX / 4 || c->pad[1] > INT64_MAX / 4)
        return fail_shape(status, op, "kernel, dilation or padding too large");
    int64_t span_h = c->h + 2 * c->pad[0] - c->dilation[0] * (c->kh - 1) - 1;
    int64_t span_w = c->w + 2 * c->pad[1] - c->dilation[1] * (c->kw - 1) - 1;
    c->oh = span_h < 0 ? 0 : span_h / c->stride[0] + 1;
    c->ow = span_w < 0 ? 0 : span_w / c->stride[1] + 1;
    if (out[0].sizes[0] != c->n || out[0].sizes[1] != c->cout || out[0].sizes[2] != c->oh ||
        out[0].sizes[3] != c->ow)
        return fail_shape(status, op, "output is not [N, Cout, OH, OW]");
    if (c->oh > 1 && c->ow > 0 && out[0].strides[2] != out[0].strides[3] * c->ow)
        return fail_shape(status, op, "output rows are not contiguous");
    return SIM_SUCCESS;
}

/* Columns [col0, col0 + cols) of the im2col matrix of batch n, group g: row (ci, ky, kx),
 * column oh * OW + ow holds the input element under that tap, 0 in the padding. */
static void im2col(const tensor_view *x, const conv_shape *c, int64_t n, int64_t g,
                   int64_t col0, int64_t cols, float *dst)
{
    int64_t cin_g = c->cin / c->groups;
    float *row = dst;
    for (int64_t ci = 0; ci < cin_g; ci++) {
        int64_t base = x->offset + n * x->strides[0] + (g * cin_g + ci) * x->strides[1];
        for (int64_t ky = 0; ky < c->kh; ky++) {
            for (int64_t kx = 0; kx < c->kw; kx++, row += cols) {
                int64_t oh = col0 / c->ow, ow = col0 % c->ow;
                for (int64_t j = 0; j < cols; j++) {
                    int64_t ih = oh * c->stride[0] - c->pad[0] + ky * c->dilation[0];
                    int64_t iw = ow * c->stride[1] - c->pad[1] + kx * c->dilation[1];
                    row[j] = ih >= 0 && ih < c->h && iw >= 0 && iw < c->w
                                 ? load_element(x, base + ih * x->strides[2] + iw * x->strides[3])
                                 : 0.0f;
                    if (++ow == c->ow) {
                        ow = 0;
                        oh++;
                    }
                }
            }
        }
    }
}

enum { IM2COL_FLOATS = 1 << 21 };   /* at most 8 MiB of columns at a time */

/* Per batch and group: out[Cout/groups, OH*OW] = weight[Cout/groups, K] @ im2col[K, OH*OW]
 * (+ bias along the rows), with gemm()'s blocks and double accumulation. */
static int32_t convolution_kernel(const flagos_kernel_args *args, flagos_status *status)
{
    static const op_signature sig = {"aten::convolution", 3, 1, 0, 7, 0x4u, 0};
    tensor_view in[MAX_TENSORS], out[MAX_TENSORS];
    conv_shape c = {0};
    int32_t rc = bind_args(args, &sig, in, out, status);
    if (rc == SIM_SUCCESS)
        rc = check_convolution(args, in, out, &c, status);
    if (rc != SIM_SUCCESS)
        return rc;
    int64_t cout_g = c.cout / c.groups, cin_g = c.cin / c.groups;
    int64_t depth = cin_g * c.kh * c.kw, spatial = c.oh * c.ow;
    if (out[0].numel == 0)
        return sim_ok(status);
    if (depth == 0 || depth > IM2COL_FLOATS)
        return sim_fail(status, FLAGOS_STATUS_UNSUPPORTED,
                        "aten::convolution: %" PRId64 " taps per output", depth);
    int64_t chunk = min_i64(spatial, IM2COL_FLOATS / depth);
    float *cols = malloc(sizeof(float) * (size_t)(depth * chunk));
    float *weights = malloc(sizeof(float) * (size_t)(cout_g * depth));
    if (cols == NULL || weights == NULL) {
        free(cols);
        free(weights);
        return sim_fail(status, SIM_ERROR_OUT_OF_MEMORY, "aten::convolution: no host memory "
                        "for %" PRId64 " columns", chunk);
    }
    tensor_view col_view = scratch_view(cols), weight_view = scratch_view(weights);
    for (int64_t g = 0; g < c.groups; g++) {
        float *w = weights;
        for (int64_t co = 0; co < cout_g; co++)
            for (int64_t ci = 0; ci < cin_g; ci++)
                for (int64_t ky = 0; ky < c.kh; ky++)
                    for (int64_t kx = 0; kx < c.kw; kx++)
                        *w++ = load_element(&in[1], in[1].offset +
                                            (g * cout_g + co) * in[1].strides[0] +
                                            ci * in[1].strides[1] + ky * in[1].strides[2] +
                                            kx * in[1].strides[3]);
        matrix a = {&weight_view, 0, depth, 1};
        matrix bias = {&in[2], in[2].offset + g * cout_g * (in[2].ndim == 1 ? in[2].strides[0] : 0),
                       in[2].ndim == 1 ? in[2].strides[0] : 0, 0};
        for (int64_t n = 0; n < c.n; n++) {
            for (int64_t col0 = 0; col0 < spatial; col0 += chunk) {
                int64_t count = min_i64(chunk, spatial - col0);
                im2col(&in[0], &c, n, g, col0, count, cols);
                matrix b = {&col_view, 0, count, 1};
                matrix o = {&out[0], out[0].offset + n * out[0].strides[0] +
                            g * cout_g * out[0].strides[1] + col0 * out[0].strides[3],
                            out[0].strides[1], out[0].strides[3]};
                gemm(&a, &b, in[2].ndim == 1 ? &bias : NULL, 1.0, 1.0, &o, cout_g, count, depth);
            }
        }
    }
    free(cols);
    free(weights);
    return sim_ok(status);
}

/* ---- group norm ------------------------------------------------------------ */

static int32_t group_norm_kernel(const flagos_kernel_args *args, flagos_status *status)
{
    static const op_signature sig = {"aten::native_group_norm", 3, 3, 1, 4, 0x6u, 0};
    const char *op = sig.op;
    tensor_view in[MAX_TENSORS], out[MAX_TENSORS];
    int32_t rc = bind_args(args, &sig, in, out, status);
    if (rc != SIM_SUCCESS)
        return rc;
    int64_t n = args->ints[0], c = args->ints[1], hxw = args->ints[2], group = args->ints[3];
    const tensor_view *x = &in[0], *w = &in[1], *b = &in[2];
    if (x->ndim != 3 || x->sizes[0] != n || x->sizes[1] != c || x->sizes[2] != hxw)
        return fail_shape(status, op, "input is not [N, C, HxW] as the ints say");
    if (group < 1 || c % group != 0)
        return fail_shape(status, op, "C does not divide into the groups");
    if ((w->ndim != -1 && (w->ndim != 1 || w->sizes[0] != c)) ||
        (b->ndim != -1 && (b->ndim != 1 || b->sizes[0] != c)))
        return fail_shape(status, op, "weight or bias is not [C]");
    if (!same_shape(x, &out[0]))
        return fail_shape(status, op, "output shape differs from the input's");
    for (int i = 1; i < 3; i++)
        if (out[i].ndim != 2 || out[i].sizes[0] != n || out[i].sizes[1] != group)
            return fail_shape(status, op, "mean or rstd is not [N, group]");
    double eps = args->scalars[0];
    int64_t per_group = c / group;
    double count = (double)(per_group * hxw);
    for (int64_t i = 0; i < n; i++) {
        for (int64_t g = 0; g < group; g++) {
            double sum = 0.0, squares = 0.0;
            for (int64_t ch = g * per_group; ch < (g + 1) * per_group; ch++) {
                int64_t at = x->offset + i * x->strides[0] + ch * x->strides[1];
                for (int64_t k = 0; k < hxw; k++)
                    sum += (double)load_element(x, at + k * x->strides[2]);
            }
            double mean = count > 0 ? sum / count : 0.0;
            for (int64_t ch = g * per_group; ch < (g + 1) * per_group; ch++) {
                int64_t at = x->offset + i * x->strides[0] + ch * x->strides[1];
                for (int64_t k = 0; k < hxw; k++) {
                    double d = (double)load_element(x, at + k * x->strides[2]) - mean;
                    squares += d * d;
                }
            }
            double rstd = 1.0 / sqrt((count > 0 ? squares / count : NAN) + eps);
            for (int64_t ch = g * per_group; ch < (g + 1) * per_group; ch++) {
                double scale = w->ndim == 1 ? rstd * load_element(w, w->offset + ch * w->strides[0]) : rstd;
                double shift = b->ndim == 1 ? load_element(b, b->offset + ch * b->strides[0]) : 0.0;
                int64_t at = x->offset + i * x->strides[0] + ch * x->strides[1];
                int64_t to = out[0].offset + i * out[0].strides[0] + ch * out[0].strides[1];
                for (int64_t k = 0; k < hxw; k++) {
                    double v = (double)load_element(x, at + k * x->strides[2]) - mean;
                    store_element(&out[0], to + k * out[0].strides[2], (float)(v * scale + shift));
                }
            }
            store_element(&out[1], out[1].offset + i * out[1].strides[0] + g * out[1].strides[1],
                          (float)mean);
            store_element(&out[2], out[2].offset + i * out[2].strides[0] + g * out[2].strides[1],
                          (float)rstd);
        }
    }
    return sim_ok(status);
}

/* ---- nearest upsampling ------------------------------------------------------ */

/* PyTorch's nearest_idx(): the source index of output index `i`. */
static int64_t nearest_source(int64_t i, int64_t in_size, int64_t out_size, double scales)
{
    if (out_size == in_size)
        return i;
    if (out_size == 2 * in_size)
        return i >> 1;
    float scale = scales > 0.0 ? (float)(1.0 / scales) : (float)in_size / (float)out_size;
    int64_t src = (int64_t)floorf((float)i * scale);
    return src < in_size - 1 ? src : in_size - 1;
}

/* Copies one element's bytes (same dtype on both sides: no conversion). */
static void copy_element(const tensor_view *dst, int64_t to, const tensor_view *src, int64_t from)
{
    uint64_t size = dtype_size(dst->dtype);
    memcpy(dst->data + (uint64_t)to * size, src->data + (uint64_t)from * size, size);
}

static int32_t upsample_nearest2d_kernel(const flagos_kernel_args *args, flagos_status *status)
{
    static const op_signature sig = {"aten::upsample_nearest2d", 1, 1, 2, 2, 0, 0};
    tensor_view in[MAX_TENSORS], out[MAX_TENSORS];
    int32_t rc = bind_args(args, &sig, in, out, status);
    if (rc != SIM_SUCCESS)
        return rc;
    const tensor_view *x = &in[0], *y = &out[0];
    if (x->ndim != 4 || y->ndim != 4 || y->sizes[0] != x->sizes[0] || y->sizes[1] != x->sizes[1] ||
        y->sizes[2] != args->ints[0] || y->sizes[3] != args->ints[1])
        return fail_shape(status, sig.op, "output is not [N, C, OH, OW] as the ints say");
    if (y->numel == 0)
        return sim_ok(status);
    if (x->numel == 0)
        return fail_shape(status, sig.op, "an empty input has no element to repeat");
    int64_t oh = y->sizes[2], ow = y->sizes[3];
    int64_t *cols = malloc(sizeof(int64_t) * (size_t)ow);
    if (cols == NULL)
        return sim_fail(status, SIM_ERROR_OUT_OF_MEMORY, "%s: no host memory", sig.op);
    for (int64_t j = 0; j < ow; j++)
        cols[j] = nearest_source(j, x->sizes[3], ow, args->scalars[1]) * x->strides[3];
    for (int64_t n = 0; n < y->sizes[0]; n++)
        for (int64_t ch = 0; ch < y->sizes[1]; ch++)
            for (int64_t i = 0; i < oh; i++) {
                int64_t src = x->offset + n * x->strides[0] + ch * x->strides[1] +
                              nearest_source(i, x->sizes[2], oh, args->scalars[0]) * x->strides[2];
                int64_t dst = y->offset + n * y->strides[0] + ch * y->strides[1] + i * y->strides[2];
                for (int64_t j = 0; j < ow; j++)
                    copy_element(y, dst + j * y->strides[3], x, src + cols[j]);
            }
    free(cols);
    return sim_ok(status);
}

/* ---- embedding ------------------------------------------------------------------ */

/* The index at element `at` of an int64 view. */
static int64_t load_index(const tensor_view *idx, int64_t at)
{
    int64_t v;
    memcpy(&v, idx->data + (uint64_t)at * 8u, sizeof v);
    return v;
}

static int32_t embedding_kernel(const flagos_kernel_args *args, flagos_status *status)
{
    static const op_signature sig = {"aten::embedding", 2, 1, 0, 0, 0, 0x2u};
    tensor_view in[MAX_TENSORS], out[MAX_TENSORS];
    int32_t rc = bind_args(args, &sig, in, out, status);
    if (rc != SIM_SUCCESS)
        return rc;
    const tensor_view *w = &in[0], *idx = &in[1], *y = &out[0];
    int32_t nd = idx->ndim;
    int fits = w->ndim == 2 && y->ndim == nd + 1 && y->sizes[nd] == w->sizes[1];
    for (int32_t d = 0; fits && d < nd; d++)
        fits = y->sizes[d] == idx->sizes[d];
    if (!fits)
        return fail_shape(status, sig.op, "not weight [V, D], indices [...] -> output [..., D]");
    if (idx->numel == 0)
        return sim_ok(status);
    int64_t rows = w->sizes[0], dim = w->sizes[1];
    /* every index first: one out of range and nothing is read (flagos then falls back) */
    nd_iter it;
    iter_start(&it, nd, idx->sizes);
    int32_t x = iter_add(&it, idx->strides, idx->offset);
    for (; it.remaining > 0; iter_next(&it)) {
        int64_t v = load_index(idx, it.pos[x]);
        if (v < 0 || v >= rows)
            return sim_fail(status, FLAGOS_STATUS_UNSUPPORTED,
                            "%s: index %" PRId64 " out of range for %" PRId64 " rows", sig.op,
                            v, rows);
    }
    iter_start(&it, nd, idx->sizes);
    x = iter_add(&it, idx->strides, idx->offset);
    int32_t o = iter_add(&it, y->strides, y->offset);
    for (; dim > 0 && it.remaining > 0; iter_next(&it)) {
        int64_t v = load_index(idx, it.pos[x]);
        for (int64_t k = 0; k < dim; k++)
            copy_element(y, it.pos[o] + k * y->strides[nd], w,
                         w->offset + v * w->strides[0] + k * w->strides[1]);
    }
    return sim_ok(status);
}

/* ---- concatenation ------------------------------------------------------------ */

enum { MAX_CAT_INPUTS = 8 };

static int32_t cat_kernel(const flagos_kernel_args *args, flagos_status *status)
{
    const char *op = "aten::cat";
    if (args == NULL || args->struct_size < sizeof(flagos_kernel_args))
        return sim_fail(status, SIM_ERROR_INVALID_VALUE, "%s: missing or truncated arguments", op);
    if (args->n_inputs < 1 || args->n_inputs > MAX_CAT_INPUTS || args->n_outputs != 1 ||
        args->n_scalars != 0 || args->n_ints != 1)
        return sim_fail(status, SIM_ERROR_INVALID_VALUE, "%s: expected 1 to %d inputs, 1 output, "
                        "0 scalars and 1 int; got %d, %d, %d and %d", op, MAX_CAT_INPUTS,
                        args->n_inputs, args->n_outputs, args->n_scalars, args->n_ints);
    if (args->inputs == NULL || args->outputs == NULL || args->ints == NULL)
        return sim_fail(status, SIM_ERROR_INVALID_VALUE, "%s: NULL argument array", op);
    int32_t dtype = args->outputs[0].dtype;
    if (!dtype_is_supported(dtype))
        return sim_fail(status, SIM_ERROR_NOT_SUPPORTED, "%s: dtype %d is not supported", op, dtype);
    tensor_view in[MAX_CAT_INPUTS], out;
    int32_t rc = bind_tensor(args, &args->outputs[0], op, "output", 0, &out, status);
    for (int32_t i = 0; rc == SIM_SUCCESS && i < args->n_inputs; i++) {
        rc = check_dtype(&args->inputs[i], dtype, op, "input", i, status);
        if (rc == SIM_SUCCESS)
            rc = bind_tensor(args, &args->inputs[i], op, "input", i, &in[i], status);
    }
    if (rc != SIM_SUCCESS)
        return rc;
    int64_t dim = args->ints[0], total = 0;
    if (out.ndim < 1 || dim < 0 || dim >= out.ndim)
        return sim_fail(status, SIM_ERROR_INVALID_VALUE, "%s: dim %" PRId64 " out of range for a "
                        "%d-d output", op, dim, out.ndim);
    for (int32_t i = 0; i < args->n_inputs; i++) {
        if (in[i].ndim != out.ndim)
            return fail_shape(status, op, "inputs and output differ in rank");
        for (int32_t d = 0; d < out.ndim; d++)
            if (d != dim && in[i].sizes[d] != out.sizes[d])
                return fail_shape(status, op, "an input differs from the output off the cat dim");
        total += in[i].sizes[dim];
    }
    if (total != out.sizes[dim])
        return fail_shape(status, op, "the inputs' sizes along dim do not add up to the output's");
    int64_t at = 0;
    for (int32_t i = 0; i < args->n_inputs; at += in[i].sizes[dim], i++) {
        if (in[i].numel == 0)
            continue;
        nd_iter it;
        iter_start(&it, out.ndim, in[i].sizes);
        int32_t x = iter_add(&it, in[i].strides, in[i].offset);
        int32_t y = iter_add(&it, out.strides, out.offset + at * out.strides[dim]);
        for (; it.remaining > 0; iter_next(&it))
            copy_element(&out, it.pos[y], &in[i], it.pos[x]);
    }
    return sim_ok(status);
}

/* ---- the table ----------------------------------------------------------- */

const flagos_kernel sim_kernels[] = {REFERENCE_KERNELS(KERNEL_TABLE_ROW)};

const int32_t sim_n_kernels = (int32_t)(sizeof sim_kernels / sizeof sim_kernels[0]);
