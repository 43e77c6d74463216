/* flagos chip adapter ABI.
 *
 * A chip without PyTorch integration joins flagos as a shared library
 * (libflagos_<chip>_adapter.so) that exports one function,
 *
 *     const flagos_adapter *flagos_adapter_get(void);
 *
 * returning a table of plain C functions. The rules, in the manner of the PJRT C API:
 *
 *  - Versioned: the table starts with struct_size and abi_major/abi_minor. flagos loads an
 *    adapter whose major equals FLAGOS_ADAPTER_ABI_MAJOR; a newer minor only appends fields,
 *    and flagos reads a field only when struct_size says the adapter has it, so adapters
 *    built against an older minor keep loading.
 *  - Every call returns a status code (0 = success, otherwise the vendor's own code) and
 *    fills the caller's flagos_status with the code and a NUL-terminated message.
 *  - Explicit sizes and ownership: device memory is named by opaque flagos_buffer handles
 *    that the adapter owns from alloc() to free(); no device pointer is ever handed to
 *    flagos, and no host pointer is kept by the adapter after a call returns.
 *  - Calls may come from any thread, but never two at once: flagos serializes them, so an
 *    adapter needs no locking for flagos's sake.
 *  - flagos checks what it hands over: every size, stride, offset and byte count is validated
 *    with overflow-checked arithmetic before a call, so copies and kernel tensors always lie
 *    inside the buffers they name, and zero-byte copies are not made at all.
 *
 * What flagos does with a broken answer (it never crashes on one):
 *  - error_name() returning NULL: the code is reported as "unnamed error".
 *  - a failing call that leaves its status unfilled: the returned code is the one reported
 *    (never status->code), with the message "the adapter gave no message"; a message without
 *    a NUL is cut at FLAGOS_STATUS_MESSAGE_SIZE - 1.
 *  - device_count() below 0 or above FLAGOS_MAX_DEVICES: flagos.AdapterError, and the chip
 *    is not used.
 *  - alloc() returning success with buffer 0: flagos.AdapterError for that allocation; flagos
 *    keeps no buffer and calls free() for nothing (an adapter that allocated anyway leaks).
 *  - a kernel table entry without an op name or function, a NULL required entry point, a
 *    table without a name: the library is refused at load with flagos.AdapterError.
 *  - init() failing: the library is refused at load with the code, name and message.
 *  - a table whose abi_minor is 1 or more but whose struct_size does not cover the fields of
 *    that minor, or with only some of the optional stream/event entries: refused at load.
 *  - stream_create() or event_create() returning success with handle 0: flagos.AdapterError
 *    for that call (nothing is kept, nothing destroyed).
 *
 * docs/adapters.md is the guide to writing one; backends/sim is the reference adapter.
 */
#ifndef FLAGOS_ADAPTER_H
#define FLAGOS_ADAPTER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FLAGOS_ADAPTER_ABI_MAJOR 1
#define FLAGOS_ADAPTER_ABI_MINOR 1
#define FLAGOS_ADAPTER_ENTRY "flagos_adapter_get"

#define FLAGOS_MAX_DIMS 8
#define FLAGOS_MAX_DEVICES 64                     /* device_count() above this is refused */
#define FLAGOS_STATUS_MESSAGE_SIZE 256

/* A kernel returns this (never a vendor code) when it cannot handle these particular
 * arguments, e.g. a layout it does not support: flagos then runs this call on the CPU
 * fallback instead of raising. */
#define FLAGOS_STATUS_UNSUPPORTED (-1)

/* ---- status ------------------------------------------------------------ */

typedef struct flagos_status {
    int32_t code;                                 /* 0: success; else the vendor code */
    char message[FLAGOS_STATUS_MESSAGE_SIZE];     /* what went wrong, for people */
} flagos_status;

/* ---- data types -------------------------------------------------------- */

typedef enum flagos_dtype {
    FLAGOS_FLOAT32 = 0,
    FLAGOS_FLOAT16 = 1,
    FLAGOS_BFLOAT16 = 2,
    FLAGOS_FLOAT64 = 3,
    FLAGOS_INT64 = 4,
    FLAGOS_INT32 = 5,
    FLAGOS_INT16 = 6,
    FLAGOS_INT8 = 7,
    FLAGOS_UINT8 = 8,
    FLAGOS_BOOL = 9,
    FLAGOS_N_DTYPES = 10
} flagos_dtype;

#define FLAGOS_DTYPE_BIT(d) ((uint64_t)1 << (d))

/* ---- devices and memory ------------------------------------------------ */

/* Opaque handle of one device allocation; 0 is never a valid buffer. */
typedef uint64_t flagos_buffer;

typedef struct flagos_device_props {
    size_t struct_size;        /* set by flagos to sizeof(flagos_device_props) */
    char name[128];
    uint64_t total_memory;     /* bytes */
    uint64_t native_dtypes;    /* FLAGOS_DTYPE_BIT mask: dtypes the chip computes in natively */
} flagos_device_props;

typedef struct flagos_memory_info {
    size_t struct_size;        /* set by flagos */
    uint64_t total;            /* capacity in bytes */
    uint64_t free;             /* bytes that can still be allocated */
    uint64_t allocated;        /* bytes held by live allocations */
    uint64_t peak_allocated;   /* highest `allocated` since start or reset_peak() */
    uint64_t reserved;         /* bytes the allocator holds from the device (>= allocated) */
} flagos_memory_info;

/* ---- kernels ----------------------------------------------------------- */

/* A tensor argument of a kernel: a strided view into one buffer. */
typedef struct flagos_tensor {
    flagos_buffer buffer;
    int64_t offset;                      /* in elements, from the start of the buffer */
    int32_t dtype;                       /* flagos_dtype */
    int32_t ndim;                        /* 0..FLAGOS_MAX_DIMS; -1: optional argument absent */
    int64_t sizes[FLAGOS_MAX_DIMS];
    int64_t strides[FLAGOS_MAX_DIMS];    /* in elements, >= 0; 0 on broadcast dimensions */
} flagos_tensor;

typedef struct flagos_kernel_args {
    size_t struct_size;                  /* sizeof(flagos_kernel_args) */
    int32_t device;
    int32_t n_inputs;
    const flagos_tensor *inputs;
    int32_t n_outputs;
    const flagos_tensor *outputs;        /* allocated by flagos: contiguous, final shapes */
    int32_t n_scalars;
    const double *scalars;
    int32_t n_ints;
    const int64_t *ints;
} flagos_kernel_args;

typedef int32_t (*flagos_kernel_fn)(const flagos_kernel_args *args, flagos_status *status);

/* One entry of the kernel table. flagos calls a kernel only when every tensor input and
 * output has the same dtype (one exception: aten::embedding's indices, below), that dtype is
 * in `dtypes` and native on the device, and the op's arguments fit the convention below;
 * every other call takes the CPU fallback. Inputs may be strided (and at a storage offset)
 * unless an op says otherwise; outputs are contiguous, of the shapes given, except where an
 * op says otherwise (native_group_norm, upsample_nearest2d and cat give a channels_last
 * output where PyTorch's result is channels_last).
 *
 * Calling convention, by op (inputs, outputs, scalars and ints in this order):
 *
 *   aten::add.Tensor, aten::sub.Tensor    in: self, other (both broadcast to the output
 *                                         shape: stride 0 on broadcast dims); scalars: alpha
 *   aten::mul.Tensor, aten::div.Tensor    in: self, other (broadcast as above)
 *   aten::add.Scalar, aten::sub.Scalar    in: self; scalars: other, alpha
 *   aten::mul.Scalar, aten::div.Scalar    in: self; scalars: other
 *       (flagos also uses the .Scalar kernels for a .Tensor op whose `other` is a 0-dim
 *        host tensor, which is how `x + 2` reaches the router)
 *       (for these and the unary ops below, flagos may hand every operand with its dims in
 *        another order, the same for all, so that a channels_last result is still a
 *        contiguous output)
 *   aten::neg, aten::relu, aten::silu,    in: self; out: same shape
 *   aten::sigmoid, aten::tanh, aten::exp
 *   aten::gelu                            in: self; ints: approximate (0 "none", 1 "tanh")
 *   aten::mm                              in: self [M,K], mat2 [K,N]; out: [M,N]
 *   aten::bmm                             in: self [B,M,K], mat2 [B,K,N]; out: [B,M,N]
 *   aten::addmm                           in: self (broadcast to [M,N]), mat1, mat2;
 *                                         scalars: beta, alpha; out = beta*self + alpha*mat1@mat2
 *   aten::sum.dim_IntList, aten::mean.dim in: self; out: keepdim shape (size 1 on reduced
 *                                         dims, same ndim as self); ints: reduced dims,
 *                                         ascending, non-negative
 *   aten::_softmax                        in: self; ints: dim (non-negative)
 *   aten::_safe_softmax                   as _softmax, and a row whose elements are all -inf
 *                                         gives zeros (attention with a fully masked row)
 *   aten::native_layer_norm               in: input, weight, bias (ndim -1 when absent);
 *                                         ints: number of normalized trailing dims;
 *                                         scalars: eps; out: output, mean, rstd (mean and
 *                                         rstd: input's leading dims, trailing dims size 1)
 *   aten::convolution                     2-d and not transposed only: in: input [N,Cin,H,W],
 *                                         weight [Cout,Cin/groups,kH,kW], bias [Cout] (ndim -1
 *                                         when absent); ints: stride_h, stride_w, pad_h, pad_w,
 *                                         dilation_h, dilation_w, groups (all >= 1, pads >= 0);
 *                                         out: [N,Cout,OH,OW], OH = (H + 2*pad_h -
 *                                         dilation_h*(kH-1) - 1) / stride_h + 1 >= 1 (OW alike);
 *                                         zero padding. (flagos declines a channels_last
 *                                         input or weight: it leaves those to the CPU)
 *   aten::native_group_norm               in: input [N,C,HxW] (the input's spatial dims as one:
 *                                         flagos declines a layout where they do not merge),
 *                                         weight [C], bias [C] (each ndim -1
 *                                         when absent); ints: N, C, HxW, group (C % group == 0);
 *                                         scalars: eps; out: output [N,C,HxW] (flagos gives it
 *                                         the input's shape; of strides (C*HxW, 1, C), i.e.
 *                                         channels_last, when the input is), mean [N,group],
 *                                         rstd [N,group] (biased variance, rstd =
 *                                         1/sqrt(var + eps))
 *   aten::upsample_nearest2d              in: self [N,C,H,W]; out: [N,C,OH,OW]; ints: OH, OW;
 *                                         scalars: scales_h, scales_w as the caller gave them
 *                                         (0 when not given). Source row of output row i, as
 *                                         PyTorch: i when OH == H, i/2 when OH == 2H, else
 *                                         min(floor(i * s), H-1) in float, s = (float)(1/scales_h)
 *                                         when scales_h > 0 else (float)H / (float)OH; columns
 *                                         alike. Output contiguous, or of channels_last
 *                                         strides when self is channels_last (PyTorch's
 *                                         layout for that result)
 *   aten::embedding                       in: weight [V,D], indices [...] (0 to 7 dims, any
 *                                         strides; dtype int64 whatever the call's dtype: the
 *                                         one input exempt from the same-dtype rule; `dtypes`
 *                                         names weight's and the output's dtype); out:
 *                                         [..., D], indices' shape + [D]. An index outside
 *                                         [0, V): the
 *                                         kernel reads no row for it and returns
 *                                         FLAGOS_STATUS_UNSUPPORTED (output contents then
 *                                         unspecified), and flagos runs the call on the CPU
 *                                         fallback, which raises PyTorch's IndexError.
 *   aten::cat                             in: 1 to 8 tensors of one rank (>= 1), alike but
 *                                         along dim (some may be empty there); ints: dim
 *                                         (non-negative); out: their concatenation along dim,
 *                                         contiguous, or of channels_last strides when every
 *                                         input is 4-d channels_last (PyTorch's layout).
 *                                         (flagos declines more tensors, 0-d or mismatched
 *                                         ones)
 *       (conventions added without an ABI version change: the table is looked up by op
 *        name, so an adapter without these entries loads and falls back for them as before)
 *
 * Copies between devices and the host are not kernels: they are the copy_* functions.
 */
typedef struct flagos_kernel {
    const char *op;                      /* "aten::add.Tensor" */
    flagos_kernel_fn fn;
    uint64_t dtypes;                     /* FLAGOS_DTYPE_BIT mask the kernel accepts */
} flagos_kernel;

/* ---- streams and events (ABI 1.1) ---------------------------------------- */

/* Opaque handle of one stream of one device; 0 is the device's default stream (it always
 * exists and is never created or destroyed). */
typedef uint64_t flagos_stream;
/* Opaque handle of one event; 0 is never a valid event. */
typedef uint64_t flagos_event;

/* event_create flag: record a timestamp. The other bits of event_create's flags are
 * reserved: flagos passes 0 for them, and an adapter may refuse a call that sets one. */
#define FLAGOS_EVENT_TIMING 1u

/* ---- the adapter table --------------------------------------------------- */

typedef struct flagos_adapter {
    size_t struct_size;                  /* sizeof(flagos_adapter) as the adapter was built */
    uint32_t abi_major;
    uint32_t abi_minor;
    const char *name;                    /* chip name: "sim" */
    const char *vendor;

    /* Called once after loading, before anything else; shutdown at process exit. */
    int32_t (*init)(flagos_status *status);
    void (*shutdown)(void);

    int32_t (*device_count)(int32_t *count, flagos_status *status);
    int32_t (*device_props)(int32_t device, flagos_device_props *props, flagos_status *status);

    int32_t (*alloc)(int32_t device, uint64_t nbytes, flagos_buffer *buffer, flagos_status *status);
    int32_t (*free)(int32_t device, flagos_buffer buffer, flagos_status *status);
    int32_t (*memory_info)(int32_t device, flagos_memory_info *info, flagos_status *status);
    int32_t (*reset_peak)(int32_t device, flagos_status *status);
    int32_t (*empty_cache)(int32_t device, flagos_status *status);

    /* Contiguous byte copies; offsets are in bytes from the start of the buffer. */
    int32_t (*copy_h2d)(int32_t device, flagos_buffer dst, uint64_t dst_offset, const void *src,
                        uint64_t nbytes, flagos_status *status);
    int32_t (*copy_d2h)(int32_t device, void *dst, flagos_buffer src, uint64_t src_offset,
                        uint64_t nbytes, flagos_status *status);
    int32_t (*copy_d2d)(int32_t dst_device, flagos_buffer dst, uint64_t dst_offset,
                        int32_t src_device, flagos_buffer src, uint64_t src_offset,
                        uint64_t nbytes, flagos_status *status);
    int32_t (*synchronize)(int32_t device, flagos_status *status);

    /* "SIM_ERROR_OUT_OF_MEMORY" for a code; never NULL (unknown codes get a generic name). */
    const char *(*error_name)(int32_t code);
    int32_t out_of_memory_code;          /* the code alloc() returns when memory runs out */
    int32_t device_lost_code;            /* the code of a device in a sticky failed state */

    int32_t n_kernels;
    const flagos_kernel *kernels;

    /* ---- ABI 1.1: streams and events, optional ---------------------------------------
     * Fill all of them or none (a table with some of them is refused at load). Without
     * them, or in an adapter built for 1.0, flagos runs every device synchronously: streams
     * and events still exist for PyTorch code, and synchronize() is the only wait.
     *
     * set_stream() makes `stream` the stream of `device` that the work flagos issues from
     * then on goes to (copies and kernels), until the next set_stream(); 0 is the default
     * stream. Work on one stream runs in order; work on two streams may overlap. Copies
     * to and from the host complete before they return (the host pointer is valid only
     * during the call) but are ordered after the earlier work of the stream. free() may be
     * called while queued work still uses the buffer: keep the memory until that work is
     * done. stream_destroy() is never called for 0, nor for the current stream (flagos
     * sets the default stream first).
     *
     * An event marks a point in one stream: event_record() captures the work queued so far
     * on `stream`; event_query() and stream_query() set *done to 1 when the work is
     * complete (an event never recorded is complete); event_elapsed_ms() gives the time
     * between two completed events created with FLAGOS_EVENT_TIMING. stream_wait_event()
     * makes later work on `stream` wait for the event without blocking the host. */
    int32_t (*stream_create)(int32_t device, int32_t priority, flagos_stream *stream,
                             flagos_status *status);
    int32_t (*stream_destroy)(int32_t device, flagos_stream stream, flagos_status *status);
    int32_t (*set_stream)(int32_t device, flagos_stream stream, flagos_status *status);
    int32_t (*stream_synchronize)(int32_t device, flagos_stream stream, flagos_status *status);
    int32_t (*stream_query)(int32_t device, flagos_stream stream, int32_t *done,
                            flagos_status *status);
    int32_t (*stream_wait_event)(int32_t device, flagos_stream stream, flagos_event event,
                                 flagos_status *status);
    int32_t (*event_create)(int32_t device, uint32_t flags, flagos_event *event,
                            flagos_status *status);
    int32_t (*event_destroy)(int32_t device, flagos_event event, flagos_status *status);
    int32_t (*event_record)(int32_t device, flagos_event event, flagos_stream stream,
                            flagos_status *status);
    int32_t (*event_synchronize)(int32_t device, flagos_event event, flagos_status *status);
    int32_t (*event_query)(int32_t device, flagos_event event, int32_t *done,
                           flagos_status *status);
    int32_t (*event_elapsed_ms)(int32_t device, flagos_event start, flagos_event end,
                                double *ms, flagos_status *status);
} flagos_adapter;

/* struct_size of a table built for ABI 1.0 (before the stream and event entries). */
#define FLAGOS_ADAPTER_SIZE_1_0 (offsetof(flagos_adapter, kernels) + sizeof(const flagos_kernel *))

typedef const flagos_adapter *(*flagos_adapter_get_fn)(void);

#ifdef __cplusplus
}
#endif
#endif
