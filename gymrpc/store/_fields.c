/* The delta between two serialised records, in C: `fields.diff(fields.split(old), fields.split(new))`.
 *
 * The Python twins (gymrpc/store/fields.py) define the format and stay the reference; this module only
 * makes the writer's side cheap: a save spent more CPU splitting and diffing in Python than everything
 * else it does. Both records are split at top-level field boundaries (nested messages are not parsed),
 * then compared field by field. Records whose fields are not in field-number order (unknown fields of
 * lower numbers written after the known ones) are refused with None: `fields.join` would not give their
 * bytes back, so the caller writes them whole.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    uint32_t number;
    const uint8_t *data;
    Py_ssize_t size;
} Entry;

typedef struct {
    Entry *items;
    Py_ssize_t count, capacity;
    Entry inline_items[64];
} Entries;

static void entries_init(Entries *e) {
    e->items = e->inline_items;
    e->count = 0;
    e->capacity = 64;
}

static void entries_free(Entries *e) {
    if (e->items != e->inline_items) PyMem_Free(e->items);
}

static int entries_push(Entries *e, uint32_t number, const uint8_t *data, Py_ssize_t size) {
    if (e->count == e->capacity) {
        Py_ssize_t grown = e->capacity * 2;
        Entry *items = PyMem_Malloc((size_t)grown * sizeof(Entry));
        if (items == NULL) return -1;
        memcpy(items, e->items, (size_t)e->count * sizeof(Entry));
        if (e->items != e->inline_items) PyMem_Free(e->items);
        e->items = items;
        e->capacity = grown;
    }
    e->items[e->count++] = (Entry){number, data, size};
    return 0;
}

/* Reads a varint of at most `max_bytes` bytes at *pos that fits in 64 bits; 0 if it runs past `end`,
 * is longer, or overflows (Python's `fields._varint` reads the same values and refuses the same lengths). */
static int read_varint(const uint8_t *data, Py_ssize_t end, Py_ssize_t *pos, int max_bytes, uint64_t *value) {
    uint64_t result = 0;
    for (int i = 0; i < max_bytes; i++) {
        if (*pos >= end) return 0;
        uint8_t byte = data[(*pos)++];
        if (i == 9 && byte > 1) return 0;
        result |= (uint64_t)(byte & 0x7F) << (7 * i);
        if (byte < 0x80) {
            *value = result;
            return 1;
        }
    }
    return 0;
}

/* 1: split; 0: not a well-formed message in field-number order; -1: out of memory (exception set).
 * Every entry accepted here is split where `fields.split` splits it, so a delta is the Python one;
 * a refusal (a tag longer than 5 bytes, say, which protobuf never writes) only means a whole write. */
static int split(const uint8_t *data, Py_ssize_t end, Entries *out) {
    Py_ssize_t pos = 0;
    uint32_t last = 0;
    while (pos < end) {
        Py_ssize_t start = pos;
        uint64_t tag, skip;
        if (!read_varint(data, end, &pos, 5, &tag) || tag > UINT32_MAX) return 0;
        uint32_t number = (uint32_t)(tag >> 3);
        switch (tag & 7) {
            case 0: /* skipped as `fields._entry` skips it: to the first byte below 0x80 */
                while (pos < end && data[pos] >= 0x80) pos++;
                pos++;
                break;
            case 1:
                pos += 8;
                break;
            case 2:
                if (!read_varint(data, end, &pos, 10, &skip) || skip > (uint64_t)(end - pos)) return 0;
                pos += (Py_ssize_t)skip;
                break;
            case 5:
                pos += 4;
                break;
            default:
                return 0;
        }
        if (pos > end || number == 0 || number < last) return 0;
        last = number;
        if (entries_push(out, number, data + start, pos - start) < 0) {
            PyErr_NoMemory();
            return -1;
        }
    }
    return 1;
}

static int same(const Entry *a, const Entry *b) {
    return a->size == b->size && memcmp(a->data, b->data, (size_t)a->size) == 0;
}

static uint8_t *put_u32(uint8_t *out, uint32_t value) {
    out[0] = (uint8_t)value;
    out[1] = (uint8_t)(value >> 8);
    out[2] = (uint8_t)(value >> 16);
    out[3] = (uint8_t)(value >> 24);
    return out + 4;
}

/* One changed field: write (or, with out == NULL, only size) its delta entry. */
static Py_ssize_t emit(uint8_t **out, uint32_t number, uint32_t kept, const Entry *added, Py_ssize_t count) {
    Py_ssize_t size = 12;
    for (Py_ssize_t i = 0; i < count; i++) size += 4 + added[i].size;
    if (*out != NULL) {
        uint8_t *p = put_u32(put_u32(put_u32(*out, number), kept), (uint32_t)count);
        for (Py_ssize_t i = 0; i < count; i++) {
            p = put_u32(p, (uint32_t)added[i].size);
            memcpy(p, added[i].data, (size_t)added[i].size);
            p += added[i].size;
        }
        *out = p;
    }
    return size;
}

/* The delta of `old` -> `new` into *out (NULL: only its size). Both are sorted by field number. */
static Py_ssize_t write_delta(const Entries *old, const Entries *new, uint8_t *out) {
    Py_ssize_t size = 0, i = 0, j = 0;
    while (i < old->count || j < new->count) {
        uint32_t a = i < old->count ? old->items[i].number : UINT32_MAX;
        uint32_t b = j < new->count ? new->items[j].number : UINT32_MAX;
        uint32_t number = a < b ? a : b;
        Py_ssize_t i0 = i, j0 = j;
        while (i < old->count && old->items[i].number == number) i++;
        while (j < new->count && new->items[j].number == number) j++;
        const Entry *before = old->items + i0, *after = new->items + j0;
        Py_ssize_t nb = i - i0, na = j - j0, common = 0;
        Py_ssize_t limit = nb < na ? nb : na;
        while (common < limit && same(before + common, after + common)) common++;
        if (common == nb && nb == na) continue; /* unchanged */
        Py_ssize_t kept = common == nb ? nb : 0; /* an old entry changed or went away: replace the field */
        size += emit(&out, number, (uint32_t)kept, after + kept, na - kept);
    }
    return size;
}

static PyObject *diff(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2 || !PyBytes_Check(args[0]) || !PyBytes_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "diff(old: bytes, new: bytes)");
        return NULL;
    }
    Entries old, new;
    entries_init(&old);
    entries_init(&new);
    PyObject *result = NULL;
    int ok = split((const uint8_t *)PyBytes_AS_STRING(args[0]), PyBytes_GET_SIZE(args[0]), &old);
    if (ok > 0) ok = split((const uint8_t *)PyBytes_AS_STRING(args[1]), PyBytes_GET_SIZE(args[1]), &new);
    if (ok == 0) {
        result = Py_NewRef(Py_None);
    } else if (ok > 0) {
        Py_ssize_t size = write_delta(&old, &new, NULL);
        result = PyBytes_FromStringAndSize(NULL, size);
        if (result != NULL) write_delta(&old, &new, (uint8_t *)PyBytes_AS_STRING(result));
    }
    entries_free(&old);
    entries_free(&new);
    return result;
}

static PyMethodDef methods[] = {
    {"diff", (PyCFunction)(void (*)(void))diff, METH_FASTCALL,
     "diff(old, new) -> bytes | None: the `fields` delta that turns record bytes `old` into `new`, or None\n"
     "if either is not a well-formed message with its top-level fields in field-number order."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "_fields",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__fields(void) { return PyModule_Create(&module); }
