/* The interned attribute names every router unit reads, created once per process. */
#include "state.h"

flagos_names fl_names;

int flagos_intern_names(void)
{
    if (fl_names.payload != NULL)
        return 0;
#define NAME(field, text)                                      \
    if ((fl_names.field = PyUnicode_InternFromString(text)) == NULL) \
        return -1;
    NAME(payload, "_payload")
    NAME(shape, "shape")
    NAME(stride, "stride")
    NAME(storage_offset, "storage_offset")
    NAME(dtype, "dtype")
    NAME(nbytes, "nbytes")
    NAME(get_device, "get_device")
    NAME(type, "type")
    NAME(index, "index")
    NAME(op, "_op")
    NAME(strides, "strides")
    NAME(device, "device")
    NAME(requires_grad, "requires_grad")
    NAME(dim, "dim")
    NAME(cpu, "is_cpu")
    NAME(clone, "clone")
#undef NAME
    return 0;
}

/* Each thread's index, with the configuration it was set under (st->device_epoch): an index
 * set before flagos was configured again (another chip, fewer devices) is not served. */
static _Thread_local int thread_device;
static _Thread_local uint64_t thread_epoch;

int flagos_current_device(const flagos_state *st)
{
    return thread_epoch == st->device_epoch ? thread_device : 0;
}

void flagos_set_current_device(const flagos_state *st, int index)
{
    thread_device = index;
    thread_epoch = st->device_epoch;
}
