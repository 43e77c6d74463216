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
