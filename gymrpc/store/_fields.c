/* The delta between two serialised records, in C: `fields.diff(fields.split(old), fields.split(new))`,
 * and the new record's CRC-32 (the delta frame's check of the whole record).
 *
 * The Python twins (gymrpc/store/fields.py) define the format and stay the reference; this module only
 * makes the writer's side cheap: a save spent more CPU splitting and diffing in Python than everything
 * else it does. Both records are split at top-level field boundaries (nested messages are not parsed),
 * then compared field by field. Records whose fields are not in field-number order (unknown fields of
 * lower numbers written after the known ones) are refused with None: `fields.join` would not give their
 * bytes back, so the caller writes them whole. The CRC is kept per field, so a record whose history only
 * grows is checksummed over what it added, not over the whole history at every save.
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

/* CRC-32 (zlib's: reflected polynomial 0xedb88320), so a record's checksum is `zlib.crc32` of its bytes.
 * Short ranges by the table loop below, long ones by Python's own `zlib.crc32`: linking zlib would make
 * the build need zlib's headers, where now it needs only Python's. */
#define CRC_POLY 0xedb88320u
static uint32_t crc_table[8][256];
static uint32_t x2n_table[32]; /* x^(2^n) mod p: how far a CRC moves past 2^n zero bits */

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ CRC_POLY : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++) crc_table[t][i] = crc_table[0][crc_table[t - 1][i] & 0xff] ^ (crc_table[t - 1][i] >> 8);
}

/* `zlib.crc32(data, crc)`: the CRC of what `crc` covered followed by `data` (slicing by 8). */
static uint32_t crc_small(uint32_t crc, const uint8_t *data, Py_ssize_t size) {
    crc = ~crc;
    while (size >= 8) {
        uint32_t one = crc ^ ((uint32_t)data[0] | (uint32_t)data[1] << 8 | (uint32_t)data[2] << 16 | (uint32_t)data[3] << 24);
        uint32_t two = (uint32_t)data[4] | (uint32_t)data[5] << 8 | (uint32_t)data[6] << 16 | (uint32_t)data[7] << 24;
        crc = crc_table[7][one & 0xff] ^ crc_table[6][(one >> 8) & 0xff] ^ crc_table[5][(one >> 16) & 0xff] ^
              crc_table[4][one >> 24] ^ crc_table[3][two & 0xff] ^ crc_table[2][(two >> 8) & 0xff] ^
              crc_table[1][(two >> 16) & 0xff] ^ crc_table[0][two >> 24];
        data += 8;
        size -= 8;
    }
    while (size-- > 0) crc = crc_table[0][(crc ^ *data++) & 0xff] ^ (crc >> 8);
    return ~crc;
}

#define CRC_BY_ZLIB 4096 /* from here on `zlib.crc32`: twice as fast as the table loop, but a call costs more */
static PyObject *zlib_crc32;

/* As `crc_small`; 0 and *ok = 0 with an exception set on failure (out of memory). */
static uint32_t crc_update(uint32_t crc, const uint8_t *data, Py_ssize_t size, int *ok) {
    if (size < CRC_BY_ZLIB) return crc_small(crc, data, size);
    PyObject *view = PyMemoryView_FromMemory((char *)data, size, PyBUF_READ);
    PyObject *result = view == NULL ? NULL : PyObject_CallFunction(zlib_crc32, "Ok", view, (unsigned long)crc);
    Py_XDECREF(view);
    unsigned long value = result == NULL ? 0 : PyLong_AsUnsignedLong(result);
    Py_XDECREF(result);
    if (PyErr_Occurred()) *ok = 0;
    return (uint32_t)value;
}

/* a * b mod p, polynomials over GF(2) in the reflected bit order (zlib's multmodp). */
static uint32_t multmodp(uint32_t a, uint32_t b) {
    uint32_t m = (uint32_t)1 << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = b & 1 ? (b >> 1) ^ CRC_POLY : b >> 1;
    }
    return p;
}

static void combine_init(void) {
    uint32_t p = (uint32_t)1 << 30; /* x^1 */
    x2n_table[0] = p;
    for (int n = 1; n < 32; n++) x2n_table[n] = p = multmodp(p, p);
}

/* The CRC of A + B from crc(A), crc(B) and len(B), in O(log len(B)) (zlib's crc32_combine). */
static uint32_t crc_combine(uint32_t crc_a, uint32_t crc_b, uint64_t size_b) {
    uint32_t p = (uint32_t)1 << 31; /* x^0 */
    for (unsigned k = 3; size_b; size_b >>= 1, k++)
        if (size_b & 1) p = multmodp(x2n_table[k & 31], p);
    return multmodp(p, crc_a) ^ crc_b;
}

#define CRC_COMBINE_FROM 512

/* A record's checksum kept per field: a save that only appends entries, or changes a few small fields,
 * checksums the bytes it changed and combines the rest, instead of reading a long history again. */
typedef struct {
    uint32_t number, count, crc, unused;
    uint64_t size;
} Sum;

typedef struct {
    uint32_t number, kept;
    Py_ssize_t first, count; /* the field's new entries: `new->items[first:first + count]` */
} Change;

/* Compares `old` and `new` field by field: the changes (a delta's content), `new`'s per-field sums and
 * its whole CRC. `old_sums` (NULL: none) must be `old`'s, as checked by the caller. 1, or 0 with an
 * exception set. */
static int compare(const Entries *old, const Entries *new, const Sum *old_sums, Change *changes, Py_ssize_t *n_changes,
                   Sum *sums, Py_ssize_t *n_sums, uint32_t *crc) {
    Py_ssize_t i = 0, j = 0, k = 0;
    int ok = 1;
    *n_changes = *n_sums = 0;
    *crc = 0;
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
        Py_ssize_t kept = common == nb ? nb : 0; /* an old entry changed or went away: replace the field */
        const Sum *prior = NULL;
        if (old_sums != NULL && nb > 0) prior = &old_sums[k++];
        if (!(common == nb && nb == na)) changes[(*n_changes)++] = (Change){number, (uint32_t)kept, j0 + kept, na - kept};
        if (na == 0) continue;
        Sum sum = {number, (uint32_t)na, 0, 0, 0};
        const uint8_t *from = after[0].data, *to = after[na - 1].data + after[na - 1].size;
        if (prior != NULL && kept == nb) { /* unchanged or grown: only the new entries are read */
            const uint8_t *grown = after[nb - 1].data + after[nb - 1].size;
            sum.crc = crc_update(prior->crc, grown, to - grown, &ok);
        } else {
            sum.crc = crc_update(0, from, to - from, &ok);
        }
        sum.size = (uint64_t)(to - from);
        /* A short field is read again: cheaper than combining (a few hundred table steps). */
        *crc = sum.size < CRC_COMBINE_FROM ? crc_small(*crc, from, to - from) : crc_combine(*crc, sum.crc, sum.size);
        sums[(*n_sums)++] = sum;
        if (!ok) return 0;
    }
    return 1;
}

/* `old_sums` if they fit `old`'s fields (one per field, in order, with its entry count and size), else NULL.
 * Sums are only ever those `revise` returned for the same bytes (`fields.NativeState` keeps the two
 * together); this check catches sums of another shape, it cannot tell two records of one shape apart. */
static const Sum *check_sums(PyObject *given, const Entries *old) {
    if (given == Py_None || !PyBytes_Check(given) || PyBytes_GET_SIZE(given) % (Py_ssize_t)sizeof(Sum)) return NULL;
    const Sum *sums = (const Sum *)PyBytes_AS_STRING(given);
    Py_ssize_t n = PyBytes_GET_SIZE(given) / (Py_ssize_t)sizeof(Sum), g = 0;
    for (Py_ssize_t i = 0; i < old->count;) {
        Py_ssize_t start = i;
        while (i < old->count && old->items[i].number == old->items[start].number) i++;
        const Entry *last = &old->items[i - 1];
        if (g >= n || sums[g].number != old->items[start].number || sums[g].count != (uint32_t)(i - start) ||
            sums[g].size != (uint64_t)(last->data + last->size - old->items[start].data))
            return NULL;
        g++;
    }
    return g == n ? sums : NULL;
}

static PyObject *revise(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3 || !PyBytes_Check(args[0]) || !PyBytes_Check(args[2]) ||
        (args[1] != Py_None && !PyBytes_Check(args[1]))) {
        PyErr_SetString(PyExc_TypeError, "revise(old: bytes, old_sums: bytes | None, new: bytes)");
        return NULL;
    }
    Entries old, new;
    entries_init(&old);
    entries_init(&new);
    PyObject *result = NULL, *delta = NULL, *sums = NULL;
    Change *changes = NULL;
    int ok = split((const uint8_t *)PyBytes_AS_STRING(args[0]), PyBytes_GET_SIZE(args[0]), &old);
    if (ok > 0) ok = split((const uint8_t *)PyBytes_AS_STRING(args[2]), PyBytes_GET_SIZE(args[2]), &new);
    if (ok == 0) {
        result = Py_BuildValue("(OOO)", Py_None, Py_None, Py_None);
        goto done;
    }
    if (ok < 0) goto done;
    Py_ssize_t fields = old.count + new.count, n_changes, n_sums;
    changes = PyMem_Malloc((size_t)(fields ? fields : 1) * sizeof(Change));
    sums = PyBytes_FromStringAndSize(NULL, (new.count ? new.count : 1) * (Py_ssize_t)sizeof(Sum));
    if (changes == NULL || sums == NULL) {
        if (changes == NULL) PyErr_NoMemory();
        goto done;
    }
    uint32_t crc;
    Sum *new_sums = (Sum *)PyBytes_AS_STRING(sums);
    if (!compare(&old, &new, check_sums(args[1], &old), changes, &n_changes, new_sums, &n_sums, &crc)) goto done;
    if (_PyBytes_Resize(&sums, n_sums * (Py_ssize_t)sizeof(Sum)) < 0) goto done;
    Py_ssize_t size = 0;
    for (Py_ssize_t c = 0; c < n_changes; c++) {
        size += 12;
        for (Py_ssize_t e = 0; e < changes[c].count; e++) size += 4 + new.items[changes[c].first + e].size;
    }
    delta = PyBytes_FromStringAndSize(NULL, size);
    if (delta == NULL) goto done;
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(delta);
    for (Py_ssize_t c = 0; c < n_changes; c++) {
        out = put_u32(put_u32(put_u32(out, changes[c].number), changes[c].kept), (uint32_t)changes[c].count);
        for (Py_ssize_t e = 0; e < changes[c].count; e++) {
            const Entry *added = &new.items[changes[c].first + e];
            out = put_u32(out, (uint32_t)added->size);
            memcpy(out, added->data, (size_t)added->size);
            out += added->size;
        }
    }
    result = Py_BuildValue("(OkO)", delta, (unsigned long)crc, sums);
done:
    Py_XDECREF(delta);
    Py_XDECREF(sums);
    PyMem_Free(changes);
    entries_free(&old);
    entries_free(&new);
    return result;
}

static PyMethodDef methods[] = {
    {"revise", (PyCFunction)(void (*)(void))revise, METH_FASTCALL,
     "revise(old, old_sums, new) -> (delta, crc, sums): the `fields` delta that turns record bytes `old` into\n"
     "`new`, `zlib.crc32(new)` and `new`'s per-field sums (the next call's `old_sums`; None: computed afresh);\n"
     "(None, None, None) if either is not a well-formed message with its top-level fields in field-number order."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "_fields",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__fields(void) {
    crc_init();
    combine_init();
    PyObject *zlib = PyImport_ImportModule("zlib");
    if (zlib == NULL) return NULL;
    Py_XSETREF(zlib_crc32, PyObject_GetAttrString(zlib, "crc32"));
    Py_DECREF(zlib);
    if (zlib_crc32 == NULL) return NULL;
    return PyModule_Create(&module);
}
