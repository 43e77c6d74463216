/* The kernel table of the opencl adapter: checks each call against the convention in
 * flagos/adapter.h, describes its strided views to the OpenCL kernels (kernels.cl) and
 * enqueues them on the current stream's queue. A call a kernel does not handle returns
 * FLAGOS_STATUS_UNSUPPORTED, and flagos runs it on the CPU fallback.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_table.h"
#include "opencl_internal.h"

#define FLOAT_DTYPES                                                                        \
    (FLAGOS_DTYPE_BIT(FLAGOS_FLOAT32) | FLAGOS_DTYPE_BIT(FLAGOS_FLOAT16) |                  \
     FLAGOS_DTYPE_BIT(FLAGOS_FLOAT64))

enum { MAX_TENSORS = 3, ANY_COUNT = -1 };

/* The kernels of kernels.cl, by index into the per-device kernel cache. */
enum {
    K_ELEMENTWISE, K_MATMUL, K_REDUCE, K_SOFTMAX, K_LAYER_NORM, K_CONV2D, K_GROUP_NORM,
    K_UPSAMPLE_NEAREST2D, K_EMBEDDING, N_CL_KERNELS
};
static const char *const cl_kernel_names[N_CL_KERNELS] = {
    "elementwise", "matmul", "reduce", "softmax", "layer_norm", "conv2d", "group_norm",
    "upsample_nearest2d", "embedding",
};
static cl_kernel kernel_cache[OCL_MAX_DEVICES][OCL_MAX_PROGRAMS][N_CL_KERNELS];

/* Element codes of kernels.cl's apply(). */
enum {
    OP_ADD, OP_SUB, OP_MUL, OP_DIV, OP_ADD_SCALAR, OP_SUB_SCALAR, OP_MUL_SCALAR, OP_DIV_SCALAR,
    OP_NEG, OP_RELU, OP_SILU, OP_SIGMOID, OP_TANH, OP_EXP, OP_GELU, OP_GELU_TANH, OP_COPY
};

/* kernels.cl's `nd`, byte for byte. */
typedef struct nd {
    int64_t size[FLAGOS_MAX_DIMS];
    int64_t stride[4][FLAGOS_MAX_DIMS];
    int64_t offset[4];
    int64_t n;
    int32_t ndim;
    int32_t pad;
} nd;

typedef struct mm_shape {
    int64_t m, n, k, batches;
    int64_t a[4], b[4], c[4], o[4];
} mm_shape;

/* kernels.cl's conv_shape, group_norm_shape, upsample_shape and embedding_shape. */
typedef struct conv_shape {
    int64_t n, cin, h, w, cout, kh, kw, oh, ow, groups;
    int64_t stride[2], pad[2], dilation[2];
    int64_t x[5], wt[5], b[2], o[5];
} conv_shape;

typedef struct group_norm_shape {
    int64_t n, c, hxw, group;
    int64_t x[4], y[4], wt[2], b[2], mean[3], rstd[3];
} group_norm_shape;

typedef struct upsample_shape {
    int64_t n, c, h, w, oh, ow;
    int64_t x[5], o[5];
} upsample_shape;

typedef struct embedding_shape {
    int64_t dim;
    int64_t wt[3];
    int64_t o_dim;
} embedding_shape;

/* A checked tensor argument with the cl_mem behind it. */
typedef struct view {
    cl_mem mem;                          /* NULL when it touches no memory or is absent */
    int32_t ndim;                        /* -1: optional tensor absent */
    int64_t offset;
    int64_t numel;
    int64_t sizes[FLAGOS_MAX_DIMS];
    int64_t strides[FLAGOS_MAX_DIMS];
} view;

typedef struct op_signature {
    const char *op;
    int32_t n_inputs, n_outputs, n_scalars, n_ints;  /* n_ints may be ANY_COUNT */
    uint32_t optional_inputs;                        /* bit i: input i may be absent */
    uint32_t index_inputs;                           /* bit i: input i is int64 (indices) */
} op_signature;

static size_t dtype_size(int32_t dtype)
{
    return dtype == FLAGOS_FLOAT64 || dtype == FLAGOS_INT64 ? 8u
           : dtype == FLAGOS_FLOAT32                        ? 4u
                                                            : 2u;
}

static int32_t unsupported(flagos_status *status, const char *op, const char *why)
{
    return ocl_fail(status, FLAGOS_STATUS_UNSUPPORTED, "%s: %s", op, why);
}

/* ---- binding the arguments ----------------------------------------------- */

static int32_t bind_tensor(int32_t device, const flagos_tensor *t, const char *op, view *v,
                           flagos_status *status)
{
    memset(v, 0, sizeof *v);
    if (t->ndim < 0 || t->ndim > FLAGOS_MAX_DIMS || t->offset < 0)
        return ocl_fail(status, OCL_ERROR_INVALID_VALUE, "%s: a tensor has ndim %d, offset %"
                        PRId64, op, t->ndim, t->offset);
    v->ndim = t->ndim;
    v->offset = t->offset;
    v->numel = 1;
    int64_t last = t->offset;
    for (int32_t d = 0; d < t->ndim; d++) {
        if (t->sizes[d] < 0 || t->strides[d] < 0)
            return ocl_fail(status, OCL_ERROR_INVALID_VALUE, "%s: negative size or stride", op);
        v->sizes[d] = t->sizes[d];
        v->strides[d] = t->strides[d];
        v->numel *= t->sizes[d]; /* flagos checked that views fit their buffers */
        if (t->sizes[d] > 1)
            last += (t->sizes[d] - 1) * t->strides[d];
    }
    if (v->numel == 0)
        return OCL_SUCCESS;
    uint64_t nbytes = 0;
    v->mem = ocl_resolve(device, t->buffer, &nbytes, status);
    if (v->mem == NULL)
        return status->code;
    if ((uint64_t)last >= nbytes / dtype_size(t->dtype))
        return ocl_fail(status, OCL_ERROR_OUT_OF_RANGE, "%s: a tensor reaches element %" PRId64
                        " past its buffer of %llu bytes", op, last, (unsigned long long)nbytes);
    return OCL_SUCCESS;
}

/* Checks counts and dtypes (index inputs: int64), binds every tensor; *dtype gets the call's dtype. */
static int32_t bind_args(const flagos_kernel_args *args, const op_signature *sig, view *in,
                         view *out, int32_t *dtype, flagos_status *status)
{
    if (args == NULL || args->struct_size < sizeof(flagos_kernel_args))
        return ocl_fail(status, OCL_ERROR_INVALID_VALUE, "%s: missing or truncated arguments",
                        sig->op);
    int ints_ok = sig->n_ints == ANY_COUNT ? args->n_ints >= 0 : args->n_ints == sig->n_ints;
    if (args->n_inputs != sig->n_inputs || args->n_outputs != sig->n_outputs ||
        args->n_scalars != sig->n_scalars || !ints_ok)
        return ocl_fail(status, OCL_ERROR_INVALID_VALUE, "%s: expected %d inputs, %d outputs "
                        "and %d scalars; got %d, %d and %d", sig->op, sig->n_inputs,
                        sig->n_outputs, sig->n_scalars, args->n_inputs, args->n_outputs,
                        args->n_scalars);
    if ((sig->n_inputs > 0 && args->inputs == NULL) || args->outputs == NULL ||
        (sig->n_scalars > 0 && args->scalars == NULL) || (args->n_ints > 0 && args->ints == NULL))
        return ocl_fail(status, OCL_ERROR_INVALID_VALUE, "%s: NULL argument array", sig->op);
    int32_t rc = ocl_check_device(args->device, status);
    if (rc != OCL_SUCCESS)
        return rc;
    *dtype = args->outputs[0].dtype;
    if (*dtype < 0 || *dtype >= FLAGOS_N_DTYPES || !(FLOAT_DTYPES & FLAGOS_DTYPE_BIT(*dtype)) ||
        !(ocl.devices[args->device].native_dtypes & FLAGOS_DTYPE_BIT(*dtype)))
        return unsupported(status, sig->op, "dtype not supported on this device");
    for (int32_t i = 0; i < sig->n_inputs; i++) {
        const flagos_tensor *t = &args->inputs[i];
        if (t->ndim == -1 && (sig->optional_inputs & (1u << i))) {
            memset(&in[i], 0, sizeof in[i]);
            in[i].ndim = -1;
            continue;
        }
        if (t->dtype != ((sig->index_inputs & (1u << i)) ? FLAGOS_INT64 : *dtype))
            return unsupported(status, sig->op, "mixed dtypes");
        if ((rc = bind_tensor(args->device, t, sig->op, &in[i], status)) != OCL_SUCCESS)
            return rc;
    }
    for (int32_t i = 0; i < sig->n_outputs; i++) {
        if (args->outputs[i].dtype != *dtype)
            return unsupported(status, sig->op, "mixed dtypes");
        rc = bind_tensor(args->device, &args->outputs[i], sig->op, &out[i], status);
        if (rc != OCL_SUCCESS)
            return rc;
    }
    return OCL_SUCCESS;
}

static int same_shape(const view *a, const view *b)
{
    if (a->ndim != b->ndim)
        return 0;
    for (int32_t d = 0; d < a->ndim; d++)
        if (a->sizes[d] != b->sizes[d])
            return 0;
    return 1;
}

/* Strides that walk `in` along `shape` (right-aligned broadcasting: missing or size-1 dims
 * get stride 0); 0 when `in` does not broadcast to `shape`. */
static int broadcast_strides(const view *in, int32_t ndim, const int64_t *shape, int64_t *strides)
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
            strides[d] = size > 1 ? in->strides[d - lead] : 0;
        else if (size != 1)
            return 0;
    }
    return 1;
}

/* ---- launching ------------------------------------------------------------- */

static int program_slot(int32_t dtype)
{
    return dtype == FLAGOS_FLOAT32 ? 0 : dtype == FLAGOS_FLOAT16 ? 1 : 2;
}

static cl_kernel get_kernel(int32_t device, int32_t dtype, int which, flagos_status *status)
{
    int slot = program_slot(dtype);
    cl_kernel *k = &kernel_cache[device][slot][which];
    if (*k != NULL)
        return *k;
    cl_program program = ocl_program(device, dtype, status);
    if (program == NULL)
        return NULL;
    cl_int err;
    *k = clCreateKernel(program, cl_kernel_names[which], &err);
    if (*k == NULL)
        ocl_cl_fail(status, err, "clCreateKernel");
    return *k;
}

void ocl_kernels_release(void)
{
    for (int d = 0; d < OCL_MAX_DEVICES; d++)
        for (int s = 0; s < OCL_MAX_PROGRAMS; s++)
            for (int k = 0; k < N_CL_KERNELS; k++)
                if (kernel_cache[d][s][k] != NULL) {
                    clReleaseKernel(kernel_cache[d][s][k]);
                    kernel_cache[d][s][k] = NULL;
                }
}

typedef struct arg_list {
    cl_uint n;
    struct { size_t size; const void *value; } items[12];
} arg_list;

static void arg(arg_list *a, size_t size, const void *value)
{
    a->items[a->n].size = size;
    a->items[a->n].value = value;
    a->n++;
}

/* A scalar argument in the kernel's ACC type (double for double tensors, else float). */
typedef union acc_value { float f; double d; } acc_value;

static void acc_arg(arg_list *a, int32_t dtype, acc_value *slot, double value)
{
    if (dtype == FLAGOS_FLOAT64) {
        slot->d = value;
        arg(a, sizeof(double), &slot->d);
    } else {
        slot->f = (float)value;
        arg(a, sizeof(float), &slot->f);
    }
}

/* Enqueues `which` over `global` work items (up to 3 dims) on the device's current queue. */
static int32_t launch(int32_t device, int32_t dtype, int which, const arg_list *a,
                      cl_uint dims, const size_t *global, flagos_status *status)
{
    cl_kernel k = get_kernel(device, dtype, which, status);
    if (k == NULL)
        return status->code;
    for (cl_uint i = 0; i < a->n; i++) {
        cl_int err = clSetKernelArg(k, i, a->items[i].size, a->items[i].value);
        if (err != CL_SUCCESS)
            return ocl_cl_fail(status, err, "clSetKernelArg");
    }
    cl_event done = NULL;
    cl_int err = clEnqueueNDRangeKernel(ocl.devices[device].current, k, dims, NULL, global, NULL,
                                        0, NULL, &done);
    if (err != CL_SUCCESS)
        return ocl_cl_fail(status, err, "clEnqueueNDRangeKernel");
    ocl_track(device, done);
    return ocl_ok(status);
}

/* Work items for a grid-stride loop over n elements. */
static size_t items_for(int64_t n)
{
    const int64_t cap = 1 << 20;
    return (size_t)(n < cap ? n : cap);
}

/* The memory of `v`, or `fallback` when it touches none (an argument must name a buffer). */
static cl_mem mem_or(const view *v, cl_mem fallback)
{
    return v->mem != NULL ? v->mem : fallback;
}

/* ---- elementwise ---------------------------------------------------------- */

static int32_t run_elementwise(const flagos_kernel_args *args, flagos_status *status,
                               const op_signature *sig, int op)
{
    view in[MAX_TENSORS], out[MAX_TENSORS];
    int32_t dtype = FLAGOS_FLOAT32;
    int32_t rc = bind_args(args, sig, in, out, &dtype, status);
    if (rc != OCL_SUCCESS)
        return rc;
    nd s;
    memset(&s, 0, sizeof s);
    s.ndim = out[0].ndim;
    s.n = out[0].numel;
    memcpy(s.size, out[0].sizes, sizeof s.size);
    memcpy(s.stride[0], out[0].strides, sizeof s.stride[0]);
    s.offset[0] = out[0].offset;
    for (int32_t i = 0; i < sig->n_inputs; i++) {
        if (!broadcast_strides(&in[i], out[0].ndim, out[0].sizes, s.stride[1 + i]))
            return unsupported(status, sig->op, "an input does not broadcast to the output");
        s.offset[1 + i] = in[i].offset;
    }
    if (s.n == 0)
        return ocl_ok(status);
    cl_mem o = out[0].mem, a = mem_or(&in[0], o), b = sig->n_inputs > 1 ? mem_or(&in[1], o) : a;
    double scalars[2] = {0.0, 0.0};
    for (int32_t i = 0; i < sig->n_scalars; i++)
        scalars[i] = args->scalars[i];
    cl_int code = op;
    acc_value s0, s1;
    arg_list list = {0};
    arg(&list, sizeof(cl_mem), &o);
    arg(&list, sizeof(cl_mem), &a);
    arg(&list, sizeof(cl_mem), &b);
    arg(&list, sizeof s, &s);
    arg(&list, sizeof code, &code);
    acc_arg(&list, dtype, &s0, scalars[0]);
    acc_arg(&list, dtype, &s1, scalars[1]);
    size_t global = items_for(s.n);
    return launch(args->device, dtype, K_ELEMENTWISE, &list, 1, &global, status);
}

#define ELEMENTWISE_KERNEL(name, op_name, n_inputs, n_scalars, code)                         \
    static int32_t name(const flagos_kernel_args *args, flagos_status *status)               \
    {                                                                                       \
        static const op_signature sig = {op_name, n_inputs, 1, n_scalars, 0, 0, 0};            \
        return run_elementwise(args, status, &sig, code);                                   \
    }

ELEMENTWISE_KERNEL(add_tensor_kernel, "aten::add.Tensor", 2, 1, OP_ADD)
ELEMENTWISE_KERNEL(sub_tensor_kernel, "aten::sub.Tensor", 2, 1, OP_SUB)
ELEMENTWISE_KERNEL(mul_tensor_kernel, "aten::mul.Tensor", 2, 0, OP_MUL)
ELEMENTWISE_KERNEL(div_tensor_kernel, "aten::div.Tensor", 2, 0, OP_DIV)
ELEMENTWISE_KERNEL(add_scalar_kernel, "aten::add.Scalar", 1, 2, OP_ADD_SCALAR)
ELEMENTWISE_KERNEL(sub_scalar_kernel, "aten::sub.Scalar", 1, 2, OP_SUB_SCALAR)
ELEMENTWISE_KERNEL(mul_scalar_kernel, "aten::mul.Scalar", 1, 1, OP_MUL_SCALAR)
ELEMENTWISE_KERNEL(div_scalar_kernel, "aten::div.Scalar", 1, 1, OP_DIV_SCALAR)
ELEMENTWISE_KERNEL(neg_kernel, "aten::neg", 1, 0, OP_NEG)
ELEMENTWISE_KERNEL(relu_kernel, "aten::relu", 1, 0, OP_RELU)
ELEMENTWISE_KERNEL(silu_kernel, "aten::silu", 1, 0, OP_SILU)
ELEMENTWISE_KERNEL(sigmoid_kernel, "aten::sigmoid", 1, 0, OP_SIGMOID)
ELEMENTWISE_KERNEL(tanh_kernel, "aten::tanh", 1, 0, OP_TANH)
ELEMENTWISE_KERNEL(exp_kernel, "aten::exp", 1, 0, OP_EXP)

static int32_t gelu_kernel(const flagos_kernel_args *args, flagos_status *status)
{
    static const op_signature sig = {"aten::gelu", 1, 1, 0, 1, 0, 0};
    if (args != NULL && args->n_ints == 1 && args->ints != NULL &&
        (args->ints[0] == 0 || args->ints[0] == 1))
        return run_elementwise(args, status, &sig, args->ints[0] ? OP_GELU_TANH : OP_GELU);
    return unsupported(status, sig.op, "approximate is neither 0 (none) nor 1 (tanh)");
}

/* ---- matrix products ------------------------------------------------------- */

static void matrix_of(const view *v, int64_t *m)
{
    int32_t r = v->ndim - 2;
    m[0] = v->offset;
    m[1] = v->ndim == 3 ? v->strides[0] : 0;
    m[2] = v->strides[r];
    m[3] = v->strides[r + 1];
}

static int32_t run_matmul(const flagos_kernel_args *args, flagos_status *status,
                          const op_signature *sig, int32_t ndim, int addmm)
{
    view in[MAX_TENSORS], out[MAX_TENSORS];
    int32_t dtype = FLAGOS_FLOAT32;
    int32_t rc = bind_args(args, sig, in, out, &dtype, status);
    if (rc != OCL_SUCCESS)
        return rc;
    const view *a = &in[addmm], *b = &in[addmm + 1], *o = &out[0];
    if (a->ndim != ndim || b->ndim != ndim || o->ndim != ndim)
        return unsupported(status, sig->op, "operands of another rank");
    int32_t r = ndim - 2;
    if ((ndim == 3 && (a->sizes[0] != b->sizes[0] || a->sizes[0] != o->sizes[0])) ||
        a->sizes[r + 1] != b->sizes[r] || o->sizes[r] != a->sizes[r] ||
        o->sizes[r + 1] != b->sizes[r + 1])
        return unsupported(status, sig->op, "shapes do not match");
    mm_shape s;
    memset(&s, 0, sizeof s);
    s.m = o->sizes[r];
    s.n = o->sizes[r + 1];
    s.k = a->sizes[r + 1];
    s.batches = ndim == 3 ? o->sizes[0] : 1;
    matrix_of(a, s.a);
    matrix_of(b, s.b);
    matrix_of(o, s.o);
    cl_int use_c = 0;
    double alpha = 1.0, beta = 0.0;
    if (addmm) {
        int64_t strides[2];
        if (!broadcast_strides(&in[0], 2, o->sizes, strides))
            return unsupported(status, sig->op, "self does not broadcast to [M, N]");
        s.c[0] = in[0].offset;
        s.c[2] = strides[0];
        s.c[3] = strides[1];
        beta = args->scalars[0];
        alpha = args->scalars[1];
        use_c = 1;
    }
    if (o->numel == 0)
        return ocl_ok(status);
    cl_mem om = o->mem, am = mem_or(a, om), bm = mem_or(b, om);
    cl_mem cm = addmm ? mem_or(&in[0], om) : om;
    acc_value av, bv;
    arg_list list = {0};
    arg(&list, sizeof(cl_mem), &om);
    arg(&list, sizeof(cl_mem), &am);
    arg(&list, sizeof(cl_mem), &bm);
    arg(&list, sizeof(cl_mem), &cm);
    arg(&list, sizeof s, &s);
    acc_arg(&list, dtype, &av, alpha);
    acc_arg(&list, dtype, &bv, beta);
    arg(&list, sizeof use_c, &use_c);
    size_t global[3] = {(size_t)s.n, (size_t)s.m, (size_t)s.batches};
    return launch(args->device, dtype, K_MATMUL, &list, 3, global, status);
}

static int32_t mm_kernel(const flagos_kernel_args *args, flagos_status *status)
{
    static const op_signature sig = {"aten::mm", 2, 1, 0, 0, 0, 0};
    return run_matmul(args, status, &sig, 2, 0);
}

static int32_t bmm_kernel(const flagos_kernel_args *args, flagos_status *status)
{
    static const op_signature sig = {"aten::bmm", 2, 1, 0, 0, 0, 0};
    return run_matmul(args, status, &sig, 3, 0);
}

static int32_t addmm_kernel(const flagos_kernel_args *args, flagos_status *status)
{
    static const op_signature sig = {"aten::addmm", 3, 1, 2, 0, 0, 0};
    return run_matmul(args, status, &sig, 2, 1);
}

/* ---- reductions and softmax ------------------------------------------------------ */

/* Splits the dims of `in` (and the same-rank `out`) into the kept ones (outer: operand 0 in,
 * 1 out) and the marked ones (inner: operand 0 in). */
static void split_dims(const view *in, const view *out, const int *marked, nd *outer, nd *inner)
{
    memset(outer, 0, sizeof *outer);
    memset(inner, 0, sizeof *inner);
    outer->offset[0] = in->offset;
    outer->offset[1] = out->offset;
    outer->n = inner->n = 1;
    for (int32_t d = 0; d < in->ndim; d++) {
        if (marked[d]) {
            inner->size[inner->ndim] = in->sizes[d];
            inner->stride[0][inner->ndim++] = in->strides[d];
            inner->n *= in->sizes[d];
        } else {
            outer->size[outer->ndim] = in->sizes[d];
            outer->stride[0][outer->ndim] = in->strides[d];
            outer->stride[1][outer->ndim++] = out->strides[d];
            outer->n *= in->sizes[d];
        }
    }
}

static int32_t run_reduction(const flagos_kernel_args *args, flagos_status *status,
                             const op_signature *sig, int mean)
{
    view in[MAX_TENSORS], out[MAX_TENSORS];
    int32_t dtype = FLAGOS_FLOAT32;
    int32_t rc = bind_args(args, sig, in, out, &dtype, status);
    if (rc != OCL_SUCCESS)
        return rc;
    int32_t ndim = in[0].ndim;
    int marked[FLAGOS_MAX_DIMS] = {0};
    for (int32_t d = 0; d < ndim && args->n_ints == 0; d++)
        marked[d] = 1;
    for (int32_t i = 0; i < args->n_ints; i++) {
        int64_t dim = args->ints[i];
        if (dim < 0 || dim >= (ndim > 0 ? ndim : 1) || (i > 0 && dim <= args->ints[i - 1]))
            return unsupported(status, sig->op, "reduced dims out of range or not ascending");
        if (ndim > 0)
            marked[dim] = 1;
    }
    if (out[0].ndim != ndim)
        return unsupported(status, sig->op, "output is not the keepdim shape");
    for (int32_t d = 0; d < ndim; d++)
        if (out[0].sizes[d] != (marked[d] ? 1 : in[0].sizes[d]))
            return unsupported(status, sig->op, "output is not the keepdim shape");
    nd outer, inner;
    split_dims(&in[0], &out[0], marked, &outer, &inner);
    if (outer.n == 0)
        return ocl_ok(status);
    cl_mem o = out[0].mem, x = mem_or(&in[0], o);
    cl_int take_mean = mean;
    arg_list list = {0};
    arg(&list, sizeof(cl_mem), &o);
    arg(&list, sizeof(cl_mem), &x);
    arg(&list, sizeof outer, &outer);
    arg(&list, sizeof inner, &inner);
    arg(&list, sizeof take_mean, &take_mean);
    size_t global = items_for(outer.n);
    return launch(args->device, dtype, K_REDUCE, &list, 1, &global, status);
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

static int32_t run_softmax(const flagos_kernel_args *args, flagos_status *status,
                           const op_signature *signature, int safe)
{
    const op_signature sig = *signature;
    view in[MAX_TENSORS], out[MAX_TENSORS];
    int32_t dtype = FLAGOS_FLOAT32;
    int32_t rc = bind_args(args, &sig, in, out, &dtype, status);
    if (rc != OCL_SUCCESS)
        return rc;
    int32_t ndim = in[0].ndim;
    int64_t dim = args->ints[0];
    if (dim < 0 || dim >= (ndim > 0 ? ndim : 1) || !same_shape(&in[0], &out[0]))
        return unsupported(status, sig.op, "dim out of range or shapes differ");
    int marked[FLAGOS_MAX_DIMS] = {0};
    if (ndim > 0)
        marked[dim] = 1;
    nd outer, inner;
    split_dims(&in[0], &out[0], marked, &outer, &inner);
    int64_t len = ndim > 0 ? in[0].sizes[dim] : 1;
    int64_t in_stride = ndim > 0 ? in[0].strides[dim] : 0;
    int64_t out_stride = ndim > 0 ? out[0].strides[dim] : 0;
    if (out[0].numel == 0)
        return ocl_ok(status);
    cl_mem o = out[0].mem, x = mem_or(&in[0], o);
    cl_long l = len, is = in_stride, os = out_stride;
    arg_list list = {0};
    arg(&list, sizeof(cl_mem), &o);
    arg(&list, sizeof(cl_mem), &x);
    arg(&list, sizeof outer, &outer);
    arg(&list, sizeof l, &l);
    arg(&list, sizeof is, &is);
    arg(&list, sizeof os, &os);
    cl_int safe_rows = safe;
    arg(&list, sizeof safe_rows, &safe_rows);
    size_t global = items_for(outer.n);
    return launch(args->device, dtype, K_SOFTMAX, &list, 1, &global, status);
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

/* ---- layer norm ---------------------------------------------------------------- */

/* Both norm kernels take y, mean, rstd, x, weight, bias (an absent one bound to another buffer,
   with its has_* flag 0), then their shape arguments, has_w, has_b and eps in the ACC type. */
static int32_t launch_norm(const flagos_kernel_args *args, int32_t dtype, int which,
                           const view *in, const view *out, const arg_list *shapes,
                           size_t global, flagos_status *status)
{
    cl_mem mean = out[1].mem, rstd = out[2].mem, y = mem_or(&out[0], mean);
    cl_mem x = mem_or(&in[0], y), w = mem_or(&in[1], y), b = mem_or(&in[2], y);
    cl_int has_w = in[1].ndim != -1 && in[1].mem != NULL;
    cl_int has_b = in[2].ndim != -1 && in[2].mem != NULL;
    acc_value eps;
    arg_list list = {0};
    arg(&list, sizeof(cl_mem), &y);
    arg(&list, sizeof(cl_mem), &mean);
    arg(&list, sizeof(cl_mem), &rstd);
    arg(&list, sizeof(cl_mem), &x);
    arg(&list, sizeof(cl_mem), &w);
    arg(&list, sizeof(cl_mem), &b);
    for (cl_uint i = 0; i < shapes->n; i++)
        arg(&list, shapes->items[i].size, shapes->items[i].value);
    arg(&list, sizeof has_w, &has_w);
    arg(&list, sizeof has_b, &has_b);
    acc_arg(&list, dtype, &eps, args->scalars[0]);
    return launch(args->device, dtype, which, &list, 1, &global, status);
}

/* weight or bias: exactly the normalized shape; its strides go to operand `k` of norm. */
static int place_param(const view *p, const view *x, int32_t axis, nd *norm, int k)
{
    if (p->ndim == -1)
        return 1;
    if (p->ndim != x->ndim - axis)
        return 0;
    for (int32_t d = 0; d < p->ndim; d++) {
        if (p->sizes[d] != x->sizes[axis + d])
            return 0;
        norm->stride[k][d] = p->strides[d];
    }
    norm->offset[k] = p->offset;
    return 1;
}

static int32_t layer_norm_kernel(const flagos_kernel_args *args, flagos_status *status)
{
    static const op_signature sig = {"aten::native_layer_norm", 3, 3, 1, 1, 0x6u, 0};
    view in[MAX_TENSORS], out[MAX_TENSORS];
    int32_t dtype = FLAGOS_FLOAT32;
    int32_t rc = bind_args(args, &sig, in, out, &dtype, status);
    if (rc != OCL_SUCCESS)
        return rc;
    const view *x = &in[0];
    int32_t ndim = x->ndim;
    int64_t n_norm = args->ints[0];
    if (n_norm < 1 || n_norm > ndim || !same_shape(x, &out[0]))
        return unsupported(status, sig.op, "normalized dims out of range or shapes differ");
    int32_t axis = ndim - (int32_t)n_norm;
    nd rows, norm;
    memset(&rows, 0, sizeof rows);
    memset(&norm, 0, sizeof norm);
    rows.n = norm.n = 1;
    for (int32_t d = 0; d < ndim; d++) {
        if (d < axis) {
            if (out[1].ndim != ndim || out[2].ndim != ndim || out[1].sizes[d] != x->sizes[d] ||
                out[2].sizes[d] != x->sizes[d])
                return unsupported(status, sig.op, "mean or rstd of another shape");
            rows.size[rows.ndim] = x->sizes[d];
            rows.stride[0][rows.ndim] = x->strides[d];
            rows.stride[1][rows.ndim] = out[0].strides[d];
            rows.stride[2][rows.ndim] = out[1].strides[d];
            rows.stride[3][rows.ndim++] = out[2].strides[d];
            rows.n *= x->sizes[d];
        } else {
            norm.size[norm.ndim] = x->sizes[d];
            norm.stride[0][norm.ndim] = x->strides[d];
            norm.stride[1][norm.ndim++] = out[0].strides[d];
            norm.n *= x->sizes[d];
        }
    }
    rows.offset[0] = x->offset;
    rows.offset[1] = out[0].offset;
    rows.offset[2] = out[1].offset;
    rows.offset[3] = out[2].offset;
    if (!place_param(&in[1], x, axis, &norm, 2) || !place_param(&in[2], x, axis, &norm, 3))
        return unsupported(status, sig.op, "weight or bias is not of the normalized shape");
    if (rows.n == 0 || out[1].mem == NULL)
        return ocl_ok(status);
    arg_list shapes = {0};
    arg(&shapes, sizeof rows, &rows);
    arg(&shapes, sizeof norm, &norm);
    return launch_norm(args, dtype, K_LAYER_NORM, in, out, &shapes, items_for(rows.n), status);
}

/* ---- convolution ---------------------------------------------------------------- */

static void dims_of(const view *v, int64_t *d)
{
    d[0] = v->offset;
    for (int32_t i = 0; i < v->ndim; i++)
        d[1 + i] = v->strides[i];
}

static int32_t convolution_kernel(const flagos_kernel_args *args, flagos_status *status)
{
    static const op_signature sig = {"aten::convolution", 3, 1, 0, 7, 0x4u, 0};
    view in[MAX_TENSORS], out[MAX_TENSORS];
    int32_t dtype = FLAGOS_FLOAT32;
    int32_t rc = bind_args(args, &sig, in, out, &dtype, status);
    if (rc != OCL_SUCCESS)
        return rc;
    const view *x = &in[0], *w = &in[1], *b = &in[2], *o = &out[0];
    const int64_t *v = args->ints;
    if (x->ndim != 4 || w->ndim != 4 || o->ndim != 4)
        return unsupported(status, sig.op, "input, weight and output must be 4-d");
    for (int i = 0; i < 7; i++)
        if ((i == 2 || i == 3) ? v[i] < 0 || v[i] > (INT64_MAX >> 4) : v[i] < 1 || v[i] > (INT64_MAX >> 4))
            return unsupported(status, sig.op, "stride, dilation, groups < 1 or padding < 0");
    conv_shape s;
    memset(&s, 0, sizeof s);
    s.n = x->sizes[0], s.cin = x->sizes[1], s.h = x->sizes[2], s.w = x->sizes[3];
    s.cout = w->sizes[0], s.kh = w->sizes[2], s.kw = w->sizes[3];
    s.stride[0] = v[0], s.stride[1] = v[1], s.pad[0] = v[2], s.pad[1] = v[3];
    s.dilation[0] = v[4], s.dilation[1] = v[5], s.groups = v[6];
    if (s.cin != w->sizes[1] * s.groups || s.cout % s.groups != 0 ||
        (b->ndim != -1 && (b->ndim != 1 || b->sizes[0] != s.cout)))
        return unsupported(status, sig.op, "channels, groups, weight and bias do not agree");
    int64_t span_h = s.h + 2 * s.pad[0] - s.dilation[0] * (s.kh - 1) - 1;
    int64_t span_w = s.w + 2 * s.pad[1] - s.dilation[1] * (s.kw - 1) - 1;
    s.oh = span_h < 0 ? 0 : span_h / s.stride[0] + 1;
    s.ow = span_w < 0 ? 0 : span_w / s.stride[1] + 1;
    if (o->sizes[0] != s.n || o->sizes[1] != s.cout || o->sizes[2] != s.oh || o->sizes[3] != s.ow)
        return unsupported(status, sig.op, "output is not [N, Cout, OH, OW]");
    dims_of(x, s.x);
    dims_of(w, s.wt);
    dims_of(o, s.o);
    if (b->ndim == 1)
        dims_of(b, s.b);
    if (o->numel == 0)
        return ocl_ok(status);
    cl_mem om = o->mem, xm = mem_or(x, om), wm = mem_or(w, om), bm = mem_or(b, om);
    cl_int has_bias = b->ndim == 1 && b->mem != NULL;
    arg_list list = {0};
    arg(&list, sizeof(cl_mem), &om);
    arg(&list, sizeof(cl_mem), &xm);
    arg(&list, sizeof(cl_mem), &wm);
    arg(&list, sizeof(cl_mem), &bm);
    arg(&list, sizeof s, &s);
    arg(&list, sizeof has_bias, &has_bias);
    enum { CO_TILE = 8 };  /* kernels.cl's: output channels per work item */
    int64_t tiles = (s.cout / s.groups + CO_TILE - 1) / CO_TILE;
    size_t global = items_for(s.n * s.groups * tiles * s.oh * s.ow);
    return launch(args->device, dtype, K_CONV2D, &list, 1, &global, status);
}

/* ---- group norm ------------------------------------------------------------------ */

static int32_t group_norm_kernel(const flagos_kernel_args *args, flagos_status *status)
{
    static const op_signature sig = {"aten::native_group_norm", 3, 3, 1, 4, 0x6u, 0};
    view in[MAX_TENSORS], out[MAX_TENSORS];
    int32_t dtype = FLAGOS_FLOAT32;
    int32_t rc = bind_args(args, &sig, in, out, &dtype, status);
    if (rc != OCL_SUCCESS)
        return rc;
    const view *x = &in[0], *w = &in[1], *b = &in[2];
    group_norm_shape s;
    memset(&s, 0, sizeof s);
    s.n = args->ints[0], s.c = args->ints[1], s.hxw = args->ints[2], s.group = args->ints[3];
    if (x->ndim != 3 || x->sizes[0] != s.n || x->sizes[1] != s.c || x->sizes[2] != s.hxw ||
        !same_shape(x, &out[0]) || s.group < 1 || s.c % s.group != 0)
        return unsupported(status, sig.op, "input is not [N, C, HxW] in groups as the ints say");
    if ((w->ndim != -1 && (w->ndim != 1 || w->sizes[0] != s.c)) ||
        (b->ndim != -1 && (b->ndim != 1 || b->sizes[0] != s.c)))
        return unsupported(status, sig.op, "weight or bias is not [C]");
    for (int i = 1; i < 3; i++)
        if (out[i].ndim != 2 || out[i].sizes[0] != s.n || out[i].sizes[1] != s.group)
            return unsupported(status, sig.op, "mean or rstd is not [N, group]");
    dims_of(x, s.x);
    dims_of(&out[0], s.y);
    dims_of(&out[1], s.mean);
    dims_of(&out[2], s.rstd);
    if (w->ndim == 1)
        dims_of(w, s.wt);
    if (b->ndim == 1)
        dims_of(b, s.b);
    if (out[1].numel == 0)
        return ocl_ok(status);
    arg_list shapes = {0};
    arg(&shapes, sizeof s, &s);
    return launch_norm(args, dtype, K_GROUP_NORM, in, out, &shapes, items_for(s.n * s.group),
                       status);
}

/* ---- nearest upsampling ------------------------------------------------------------- */

/* PyTorch's source step: (float)(1 / scales) for a given scale, else in / out in float. */
static float nearest_scale(double scales, int64_t in_size, int64_t out_size)
{
    return scales > 0.0 ? (float)(1.0 / scales) : (float)in_size / (float)out_size;
}

static int32_t upsample_nearest2d_kernel(const flagos_kernel_args *args, flagos_status *status)
{
    static const op_signature sig = {"aten::upsample_nearest2d", 1, 1, 2, 2, 0, 0};
    view in[MAX_TENSORS], out[MAX_TENSORS];
    int32_t dtype = FLAGOS_FLOAT32;
    int32_t rc = bind_args(args, &sig, in, out, &dtype, status);
    if (rc != OCL_SUCCESS)
        return rc;
    const view *x = &in[0], *o = &out[0];
    if (x->ndim != 4 || o->ndim != 4 || o->sizes[0] != x->sizes[0] || o->sizes[1] != x->sizes[1] ||
        o->sizes[2] != args->ints[0] || o->sizes[3] != args->ints[1])
        return unsupported(status, sig.op, "output is not [N, C, OH, OW] as the ints say");
    if (o->numel == 0)
        return ocl_ok(status);
    if (x->numel == 0)
        return unsupported(status, sig.op, "an empty input has no element to repeat");
    upsample_shape s;
    memset(&s, 0, sizeof s);
    s.n = x->sizes[0], s.c = x->sizes[1], s.h = x->sizes[2], s.w = x->sizes[3];
    s.oh = o->sizes[2], s.ow = o->sizes[3];
    dims_of(x, s.x);
    dims_of(o, s.o);
    cl_float scale_h = nearest_scale(args->scalars[0], s.h, s.oh);
    cl_float scale_w = nearest_scale(args->scalars[1], s.w, s.ow);
    cl_mem om = o->mem, xm = x->mem;
    arg_list list = {0};
    arg(&list, sizeof(cl_mem), &om);
    arg(&list, sizeof(cl_mem), &xm);
    arg(&list, sizeof s, &s);
    arg(&list, sizeof scale_h, &scale_h);
    arg(&list, sizeof scale_w, &scale_w);
    size_t global = items_for(o->numel);
    return launch(args->device, dtype, K_UPSAMPLE_NEAREST2D, &list, 1, &global, status);
}

/* ---- embedding ---------------------------------------------------------------------- */

/* Reads the indices to the host (after the queue's earlier work) and checks each against the
 * table's rows: one out of range and the call is declined before any row is read. */
static int32_t check_indices(int32_t device, const view *idx, int64_t rows, flagos_status *status)
{
    int64_t span = 1;
    for (int32_t d = 0; d < idx->ndim; d++)
        span += (idx->sizes[d] - 1) * idx->strides[d];
    int64_t *host = malloc(sizeof(int64_t) * (size_t)span);
    if (host == NULL)
        return ocl_fail(status, OCL_ERROR_HOST_MEMORY, "aten::embedding: no host memory for "
                        "%" PRId64 " indices", span);
    cl_int err = clEnqueueReadBuffer(ocl.devices[device].current, idx->mem, CL_TRUE,
                                     (size_t)idx->offset * sizeof(int64_t),
                                     (size_t)span * sizeof(int64_t), host, 0, NULL, NULL);
    int32_t rc = err == CL_SUCCESS ? OCL_SUCCESS : ocl_cl_fail(status, err, "clEnqueueReadBuffer");
    for (int64_t i = 0; rc == OCL_SUCCESS && i < idx->numel; i++) {
        int64_t at = 0, rest = i;
        for (int32_t d = idx->ndim - 1; d >= 0; d--) {
            at += (rest % idx->sizes[d]) * idx->strides[d];
            rest /= idx->sizes[d];
        }
        if (host[at] < 0 || host[at] >= rows)
            rc = ocl_fail(status, FLAGOS_STATUS_UNSUPPORTED, "aten::embedding: index %" PRId64
                          " out of range for %" PRId64 " rows", host[at], rows);
    }
    free(host);
    return rc;
}

static int32_t embedding_kernel(const flagos_kernel_args *args, flagos_status *status)
{
    static const op_signature sig = {"aten::embedding", 2, 1, 0, 0, 0, 0x2u};
    view in[MAX_TENSORS], out[MAX_TENSORS];
    int32_t dtype = FLAGOS_FLOAT32;
    int32_t rc = bind_args(args, &sig, in, out, &dtype, status);
    if (rc != OCL_SUCCESS)
        return rc;
    const view *w = &in[0], *idx = &in[1], *o = &out[0];
    int32_t nd_idx = idx->ndim;
    int fits = w->ndim == 2 && o->ndim == nd_idx + 1 && o->sizes[nd_idx] == w->sizes[1];
    for (int32_t d = 0; fits && d < nd_idx; d++)
        fits = o->sizes[d] == idx->sizes[d];
    if (!fits)
        return unsupported(status, sig.op, "not weight [V, D], indices [...] -> output [..., D]");
    if (idx->numel == 0)
        return ocl_ok(status);
    if ((rc = check_indices(args->device, idx, w->sizes[0], status)) != OCL_SUCCESS)
        return rc;
    if (o->numel == 0)
        return ocl_ok(status);
    embedding_shape s;
    memset(&s, 0, sizeof s);
    s.dim = w->sizes[1];
    dims_of(w, s.wt);
    s.o_dim = o->strides[nd_idx];
    nd rows;
    memset(&rows, 0, sizeof rows);
    rows.ndim = nd_idx;
    rows.n = idx->numel;
    memcpy(rows.size, idx->sizes, sizeof rows.size);
    memcpy(rows.stride[0], idx->strides, sizeof rows.stride[0]);
    memcpy(rows.stride[1], o->strides, sizeof(int64_t) * (size_t)nd_idx);
    rows.offset[0] = idx->offset;
    rows.offset[1] = o->offset;
    cl_mem om = o->mem, wm = w->mem, im = idx->mem;
    arg_list list = {0};
    arg(&list, sizeof(cl_mem), &om);
    arg(&list, sizeof(cl_mem), &wm);
    arg(&list, sizeof(cl_mem), &im);
    arg(&list, sizeof s, &s);
    arg(&list, sizeof rows, &rows);
    size_t global = items_for(o->numel);
    return launch(args->device, dtype, K_EMBEDDING, &list, 1, &global, status);
}

/* ---- concatenation -------------------------------------------------------------------- */

enum { MAX_CAT_INPUTS = 8 };

/* Each non-empty input copied into its slice of the output by the elementwise kernel. */
static int32_t cat_kernel(const flagos_kernel_args *args, flagos_status *status)
{
    const char *op = "aten::cat";
    if (args == NULL || args->struct_size < sizeof(flagos_kernel_args) || args->n_inputs < 1 ||
        args->n_inputs > MAX_CAT_INPUTS || args->n_outputs != 1 || args->n_scalars != 0 ||
        args->n_ints != 1 || args->inputs == NULL || args->outputs == NULL || args->ints == NULL)
        return ocl_fail(status, OCL_ERROR_INVALID_VALUE, "%s: expected 1 to %d inputs, 1 output "
                        "and 1 int", op, MAX_CAT_INPUTS);
    int32_t rc = ocl_check_device(args->device, status);
    if (rc != OCL_SUCCESS)
        return rc;
    int32_t dtype = args->outputs[0].dtype;
    if (dtype < 0 || dtype >= FLAGOS_N_DTYPES || !(FLOAT_DTYPES & FLAGOS_DTYPE_BIT(dtype)) ||
        !(ocl.devices[args->device].native_dtypes & FLAGOS_DTYPE_BIT(dtype)))
        return unsupported(status, op, "dtype not supported on this device");
    view in[MAX_CAT_INPUTS], out;
    if ((rc = bind_tensor(args->device, &args->outputs[0], op, &out, status)) != OCL_SUCCESS)
        return rc;
    int64_t dim = args->ints[0], total = 0;
    if (out.ndim < 1 || dim < 0 || dim >= out.ndim)
        return unsupported(status, op, "dim out of range");
    for (int32_t i = 0; i < args->n_inputs; i++) {
        if (args->inputs[i].dtype != dtype)
            return unsupported(status, op, "mixed dtypes");
        if ((rc = bind_tensor(args->device, &args->inputs[i], op, &in[i], status)) != OCL_SUCCESS)
            return rc;
        if (in[i].ndim != out.ndim)
            return unsupported(status, op, "inputs and output differ in rank");
        for (int32_t d = 0; d < out.ndim; d++)
            if (d != dim && in[i].sizes[d] != out.sizes[d])
                return unsupported(status, op, "an input differs from the output off the cat dim");
        total += in[i].sizes[dim];
    }
    if (total != out.sizes[dim])
        return unsupported(status, op, "the inputs' sizes along dim do not add up");
    int64_t at = 0;
    for (int32_t i = 0; i < args->n_inputs; at += in[i].sizes[dim], i++) {
        if (in[i].numel == 0)
            continue;
        nd s;
        memset(&s, 0, sizeof s);
        s.ndim = out.ndim;
        s.n = in[i].numel;
        memcpy(s.size, in[i].sizes, sizeof s.size);
        memcpy(s.stride[0], out.strides, sizeof s.stride[0]);
        memcpy(s.stride[1], in[i].strides, sizeof s.stride[1]);
        s.offset[0] = out.offset + at * out.strides[dim];
        s.offset[1] = in[i].offset;
        cl_mem o = out.mem, a = in[i].mem;
        cl_int code = OP_COPY;
        acc_value s0, s1;
        arg_list list = {0};
        arg(&list, sizeof(cl_mem), &o);
        arg(&list, sizeof(cl_mem), &a);
        arg(&list, sizeof(cl_mem), &a);
        arg(&list, sizeof s, &s);
        arg(&list, sizeof code, &code);
        acc_arg(&list, dtype, &s0, 0.0);
        acc_arg(&list, dtype, &s1, 0.0);
        size_t global = items_for(s.n);
        if ((rc = launch(args->device, dtype, K_ELEMENTWISE, &list, 1, &global, status)) != OCL_SUCCESS)
            return rc;
    }
    return ocl_ok(status);
}

/* ---- the table ----------------------------------------------------------------- */

const flagos_kernel ocl_kernels[] = {REFERENCE_KERNELS(KERNEL_TABLE_ROW)};

const int32_t ocl_n_kernels = (int32_t)(sizeof ocl_kernels / sizeof ocl_kernels[0]);
