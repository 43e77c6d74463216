/* The state the router's units share: the op table's entries, the module state that
 * configure() fills, and the interned attribute names (state.c). Types and data only: no unit
 * is called through this header but state.c's flagos_intern_names().
 */
#ifndef FLAGOS_STATE_H
#define FLAGOS_STATE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <uthash.h>

/* Route values; the numbering is shared with flagos/core/_routes.py. */
enum flagos_route {
    ROUTE_UNRESOLVED = -1,
    ROUTE_OVERRIDE = 0,
    ROUTE_NATIVE = 1,
    ROUTE_FALLBACK = 2,
    ROUTE_ERROR = 3,
    N_ROUTES = 4
};

/* op_entry.flags */
#define OP_VIEW (1u << 0)         /* returns an alias of an input: never falls back */
#define OP_CROSS_DEVICE (1u << 1) /* copy-like: inputs may live on other devices */
#define OP_DEVICE_ARG (1u << 2)   /* has a Device argument: it decides the output side */
#define OP_WARNED (1u << 3)       /* the fallback warning was given */
#define OP_NOT_IMPLEMENTED (1u << 4) /* the chip kernel raised NotImplementedError */
#define OP_FALLBACK_SITE (1u << 5) /* site is where the op first fell back */
#define OP_RELAYOUT (1u << 6)     /* may change a written tensor's shape/strides (out=, t_) */
#define OP_SPARSE (1u << 7)       /* makes a sparse tensor: flagos tensors are strided only */
#define OP_DTYPE_KW (1u << 8)     /* has a keyword `dtype` (ScalarType?): it picks the output dtype */
#define OP_DECOMPOSES (1u << 9)   /* CompositeImplicitAutograd: reaches flagos whole only in
                                     inference mode; an adapter without its kernel runs its parts */
#define OP_MATH_KEYS (1u << 10)   /* a decomposition that may make complex values of real inputs:
                                     called with the conjugate and negative keys on */
#define OP_HOST_OUTPUT1 (1u << 11) /* its second output is a host tensor on every device (a packed
                                      sequence's batch sizes): it stays one */
#define OP_NESTED (1u << 12)      /* makes a strided nested tensor: flagos tensors are not nested */
#define OP_DEVICE_KERNEL (1u << 13) /* its override is the device's own kernel (torch.library's
                                       PrivateUse1 one): called with the flagos tensors themselves */

typedef struct op_entry {
    PyObject *func;          /* key: the OpOverload (strong ref keeps the pointer valid) */
    PyObject *call;          /* func._op when present: skips a Python frame per call */
    PyObject *name;          /* "aten::add.Tensor" */
    PyObject *arg_names;     /* tuple of schema argument names, positional order */
    PyObject *write_args;    /* tuple of argument indices written by the op (schema "!") */
    PyObject *return_alias;  /* tuple: per return, index of the written argument it is, or -1 */
    PyObject *override;      /* override kernel for the active chip, or NULL */
    PyObject *site;          /* first call site in user code ("file:line"), or NULL */
    int route;               /* resolved route, or ROUTE_UNRESOLVED */
    unsigned flags;
    uint64_t calls[N_ROUTES];
    uint64_t fallback_ns;
    uint64_t bytes_to_host;
    uint64_t bytes_to_device;
    uint64_t dtype_mask;     /* bit i: dtype i of the state's dtype registry seen in fallback */
    uint64_t downcast_calls; /* calls whose `dtype` the downcast policy rewrote */
    uint64_t downcast_bytes; /* bytes of the tensors those calls made */
    /* adapter_fast.c's answer for this op on the configured adapter (valid while
     * fast_generation equals the state's): its kind (FAST_*), kernel index and dtype mask */
    int fast_kind;
    int32_t fast_kernel;
    uint64_t fast_kernel_dtypes;
    uint64_t fast_generation;
    int fast_fallback;       /* when adapter_fallback.c may run its host round trip
                              * (FAST_FALLBACK_*, adapter_fast.h), valid with fast_generation */
    Py_ssize_t users;        /* calls running with this entry (and exports reading it) */
    int detached;            /* cleared from the table while in use: its last user frees it */
    struct op_entry *next_cleared; /* flagos_table_clear's list of the entries it removed */
    UT_hash_handle hh;
} op_entry;

/* Wrappers own no memory; their nominal storage is this large so that their metadata can be
 * updated in place (out= resizes, in-place view ops) without a bounds error. */
#define WRAPPER_STORAGE_BYTES ((long long)1 << 62)

#define MAX_DTYPES 64
#define MAX_DEVICES 64

/* What the router needs to know about the active chip and torch, set by configure(). */
typedef struct flagos_state {
    op_entry *table;
    uint64_t routes_generation; /* bumped by every route change and table clear */
    int configured;
    int device_mode;           /* 1: flagos owns PrivateUse1 and tensors are wrappers */
    int chip_is_host;          /* the chip's payloads live in host memory (cpu chip) */
    int fallback_policy;       /* 0 allow, 1 warn, 2 error */
    uint64_t device_epoch;     /* bumped by every configure(): each thread's current device,
                                * set under an older one, is flagos:0 again (flagos_current_device) */
    unsigned long long compiled_calls; /* calls of compiled flagos graphs (count_compiled_call) */
    PyObject *tensor_type;     /* torch.Tensor */
    PyObject *device_type;     /* torch.device */
    PyObject *wrapper_type;    /* flagos.FlagosTensor (device mode) */
    PyObject *make_wrapper;    /* torch.Tensor._make_wrapper_subclass */
    PyObject *to_copy;         /* aten._to_copy.default */
    PyObject *copy_;           /* aten.copy_.default */
    PyObject *host_device;     /* torch.device("cpu") */
    PyObject *chip_devices;    /* tuple: payload device per flagos index */
    PyObject *flagos_devices;  /* tuple: torch.device("flagos", i) */
    PyObject *describe;        /* Python: OpOverload -> schema facts (once per op) */
    PyObject *resolve;         /* Python: op name -> (route, override) */
    PyObject *fallback_warning;/* warning category */
    PyObject *fallback_error;  /* exception type for policy "error" */
    PyObject *device_mismatch; /* exception type for mixed devices */
    PyObject *skip_prefixes;   /* tuple of path prefixes that are not user code */
    PyObject *adapter_dispatch;/* C-ABI chips: Python runner of one op, or NULL */
    /* C-ABI chips: the common case of kernel-table ops runs in C (adapter_fast.c), from the
     * runner's `c_fast` = (adapter, native dtype mask per device, torch.dtype per flagos code) */
    PyObject *fast_adapter;    /* the runner's flagos._C.Adapter, or NULL: no op runs in C */
    PyObject *fast_dtypes;     /* tuple: the torch.dtype of each flagos_dtype code */
    PyObject *fast_runner_ops; /* frozenset: names the runner always handles itself, or NULL */
    PyObject *fast_kernel_ops; /* frozenset: names it tries a kernel for when routed native */
    uint64_t fast_native[MAX_DEVICES]; /* per device: the dtypes it computes in natively */
    int fast_n_devices;
    uint64_t fast_generation;  /* bumped by every configure(): entries look their kernel up again */
    PyObject *set_metadata;    /* (wrapper, size, stride, offset): resync a wrapper's view */
    PyObject *math_call;       /* Python: (fn, args, kwargs) with the conj/neg keys enabled */
    PyObject *complex_dtypes;  /* tuple of the complex torch.dtype objects */
    /* dtype_policy="downcast" (flagos/_activation.py): a `dtype=downcast_from` keyword of an op
     * whose output is on the flagos device becomes `dtype=downcast_to`. NULL: strict, no rewrite. */
    PyObject *downcast_from;      /* torch.bfloat16 */
    PyObject *downcast_to;        /* torch.float16 or torch.float32 */
    PyObject *downcast_device_type; /* "flagos": a `device` keyword of another type is left alone */
    PyObject *downcast_warning;   /* warning category, given once at the first rewrite */
    PyObject *downcast_message;   /* its text */
    int downcast_warned;
    /* Why this process may not use the chip (a fork of a process whose chip does not survive
     * fork: refuse_forked_child()), or NULL. Raised by every call while set. */
    PyObject *refusal;
    PyObject *dtypes[MAX_DTYPES]; /* registry for dtype_mask (strong refs) */
    int n_dtypes;
} flagos_state;

/* Interned attribute names, created once at module init. */
typedef struct flagos_names {
    PyObject *payload, *shape, *stride, *storage_offset, *dtype, *nbytes, *get_device,
        *type, *index, *op, *strides, *device, *requires_grad, *dim, *cpu, *clone;
} flagos_names;
extern flagos_names fl_names;

/* Creates fl_names once per process (module init); 0, or -1 with an error set. */
int flagos_intern_names(void);

/* The calling thread's current device (torch.flagos.set_device: what "flagos" without an index
 * means), as CUDA's is: flagos:0 in a thread that has not set one under this configuration. */
int flagos_current_device(const flagos_state *st);
void flagos_set_current_device(const flagos_state *st, int index);

#endif
