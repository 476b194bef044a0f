// GGUF reader (v2 and v3, little-endian). gguf_open checks every count and length against
// the bytes left in the file before it allocates for them, so a damaged or hostile file ends
// in INNERQ_ERR_FORMAT with a message that says what is wrong and where, never in a crash or
// a huge allocation. Strings and numeric arrays are used in place; when mmap is off the whole
// file is read into one allocation so that they have somewhere to live.
#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif

#include "gguf.h"

#include "iq.h"
#include "status.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define GGUF_DEFAULT_ALIGNMENT 32
// The smallest encodings of a key/value pair (empty key, type, one-byte value) and of a
// tensor info (empty name, n_dims, one dim, type, offset): they bound the counts.
#define GGUF_MIN_KV_BYTES (8 + 4 + 1)
#define GGUF_MIN_TENSOR_BYTES (8 + 4 + 8 + 4 + 8)

static const size_t gguf_vtype_size[GGUF_TYPE_COUNT] = {
    [GGUF_TYPE_UINT8] = 1, [GGUF_TYPE_INT8] = 1,     [GGUF_TYPE_UINT16] = 2, [GGUF_TYPE_INT16] = 2,
    [GGUF_TYPE_UINT32] = 4, [GGUF_TYPE_INT32] = 4,   [GGUF_TYPE_FLOAT32] = 4, [GGUF_TYPE_BOOL] = 1,
    [GGUF_TYPE_UINT64] = 8, [GGUF_TYPE_INT64] = 8,   [GGUF_TYPE_FLOAT64] = 8,
};

static const char * const gguf_vtype_name[GGUF_TYPE_COUNT] = {
    "uint8", "int8", "uint16", "int16", "uint32", "int32", "float32", "bool", "string", "array",
    "uint64", "int64", "float64",
};

// ggml types that innerq has no kernels for: a file using one is valid but can't be served,
// which deserves a different answer (INNERQ_ERR_UNSUPPORTED) than a corrupt type field.
static const char * const gguf_foreign_type_name[] = {
    [16] = "iq2_xxs", [17] = "iq2_xs", [18] = "iq3_xxs", [19] = "iq1_s", [21] = "iq3_s", [22] = "iq2_s",
    [27] = "i64",     [28] = "f64",    [29] = "iq1_m",   [34] = "tq1_0", [35] = "tq2_0", [39] = "mxfp4",
};

// ---- name index: open addressing over names that live elsewhere ----

struct gguf_slot {
    const char * name;  // NULL: empty
    int64_t i;
};

struct gguf_index {
    struct gguf_slot * slots;
    uint64_t mask;
};

// The whole object gguf_open hands out; the public part comes first.
struct gguf_impl {
    struct gguf_file f;
    struct gguf_index kv_index;
    struct gguf_index tensor_index;
};

static uint64_t gguf_hash(const char * s) {
    uint64_t h = 14695981039346656037ull;  // FNV-1a
    for (; *s; s++) {
        h = (h ^ (uint8_t) *s) * 1099511628211ull;
    }
    return h;
}

static bool gguf_index_init(struct gguf_index * ix, int64_t n) {
    uint64_t cap = 8;
    while (cap < 2 * (uint64_t) n) {
        cap *= 2;
    }
    ix->slots = calloc(cap, sizeof(*ix->slots));
    ix->mask = cap - 1;
    return ix->slots != NULL;
}

// The slot holding name, or the empty slot where it belongs.
static struct gguf_slot * gguf_index_slot(const struct gguf_index * ix, const char * name) {
    uint64_t h = gguf_hash(name) & ix->mask;
    while (ix->slots[h].name && strcmp(ix->slots[h].name, name) != 0) {
        h = (h + 1) & ix->mask;
    }
    return &ix->slots[h];
}

static int64_t gguf_index_find(const struct gguf_index * ix, const char * name) {
    if (ix->slots == NULL) {
        return -1;
    }
    const struct gguf_slot * s = gguf_index_slot(ix, name);
    return s->name ? s->i : -1;
}

// Records name as entry i; false if the name is already there.
static bool gguf_index_add(struct gguf_index * ix, const char * name, int64_t i) {
    struct gguf_slot * s = gguf_index_slot(ix, name);
    if (s->name) {
        return false;
    }
    s->name = name;
    s->i = i;
    return true;
}

// ---- reading the header ----

struct gguf_reader {
    const char * path;
    const uint8_t * base;
    size_t size;
    size_t pos;
    char what[128];  // the entry being read ("key 'general.name'", "tensor #3"), for messages
};

// Bytes of a name as a message can show them: printable ASCII, others as \xNN, cut at 64.
static void gguf_quote(char * dst, size_t dst_size, const char * s, size_t n) {
    size_t o = 0;
    for (size_t i = 0; i < n && o + 8 < dst_size; i++) {
        const uint8_t c = (uint8_t) s[i];
        if (i == 64) {
            o += (size_t) snprintf(dst + o, dst_size - o, "...");
            break;
        }
        o += (size_t) snprintf(dst + o, dst_size - o, c >= 0x20 && c < 0x7f && c != '\\' ? "%c" : "\\x%02x", c);
    }
    dst[o] = '\0';
}

static innerq_status reader_fail(const struct gguf_reader * r, innerq_status st, const char * fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

static innerq_status reader_fail(const struct gguf_reader * r, innerq_status st, const char * fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    if (r->what[0]) {
        return innerq_fail(st, "%s: %s: %s", r->path, r->what, msg);
    }
    return innerq_fail(st, "%s: %s", r->path, msg);
}

static size_t reader_left(const struct gguf_reader * r) { return r->size - r->pos; }

// The reader_* functions set their output even when they fail, so that no caller reads an
// uninitialised value whatever it does with the status.
static innerq_status reader_take(struct gguf_reader * r, size_t n, const char * field, const uint8_t ** out) {
    *out = NULL;
    if (n > reader_left(r)) {
        return reader_fail(r, INNERQ_ERR_FORMAT,
                           "truncated: the %s needs %zu bytes at offset %zu, the file ends at %zu",
                           field, n, r->pos, r->size);
    }
    *out = r->base + r->pos;
    r->pos += n;
    return INNERQ_OK;
}

static uint64_t gguf_load_le(const uint8_t * p, size_t n) {
    uint64_t v = 0;
    for (size_t i = n; i-- > 0;) {
        v = v << 8 | p[i];
    }
    return v;
}

static innerq_status reader_uint(struct gguf_reader * r, size_t n, const char * field, uint64_t * out) {
    const uint8_t * p;
    innerq_status st = reader_take(r, n, field, &p);
    *out = st == INNERQ_OK ? gguf_load_le(p, n) : 0;
    return st;
}

static innerq_status reader_u32(struct gguf_reader * r, const char * field, uint32_t * out) {
    uint64_t v;
    innerq_status st = reader_uint(r, 4, field, &v);
    *out = (uint32_t) v;
    return st;
}

static innerq_status reader_str(struct gguf_reader * r, const char * field, struct gguf_str * out) {
    uint64_t n;
    *out = (struct gguf_str) { 0, NULL };
    innerq_status st = reader_uint(r, 8, field, &n);
    if (st != INNERQ_OK) {
        return st;
    }
    if (n > reader_left(r)) {
        return reader_fail(r, INNERQ_ERR_FORMAT,
                           "%s length %" PRIu64 " exceeds the file (%zu bytes left at offset %zu)",
                           field, n, reader_left(r), r->pos);
    }
    out->n = n;
    out->data = (const char *) r->base + r->pos;
    r->pos += n;
    return INNERQ_OK;
}

// A NUL-terminated copy of a key or tensor name (which must not hold a NUL of its own).
static innerq_status reader_name(struct gguf_reader * r, const char * field, char ** out) {
    struct gguf_str s;
    innerq_status st = reader_str(r, field, &s);
    if (st != INNERQ_OK) {
        return st;
    }
    if (memchr(s.data, '\0', s.n) != NULL) {
        return reader_fail(r, INNERQ_ERR_FORMAT, "the %s contains a NUL byte", field);
    }
    *out = malloc(s.n + 1);
    if (*out == NULL) {
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "%s: out of memory reading the %s", r->path, field);
    }
    memcpy(*out, s.data, s.n);
    (*out)[s.n] = '\0';
    return INNERQ_OK;
}

// Sets kv->type and kv->num from the little-endian bytes of one scalar.
static void gguf_num_decode(struct gguf_kv * kv, enum gguf_vtype type, const uint8_t * p) {
    const uint64_t v = gguf_load_le(p, gguf_vtype_size[type]);
    kv->type = type;
    switch (type) {
        case GGUF_TYPE_INT8: kv->num.i64 = (int8_t) v; break;
        case GGUF_TYPE_INT16: kv->num.i64 = (int16_t) v; break;
        case GGUF_TYPE_INT32: kv->num.i64 = (int32_t) v; break;
        case GGUF_TYPE_INT64: kv->num.i64 = (int64_t) v; break;
        case GGUF_TYPE_FLOAT32: {
            uint32_t b = (uint32_t) v;
            float x;
            memcpy(&x, &b, sizeof(x));
            kv->num.f64 = x;
            break;
        }
        case GGUF_TYPE_FLOAT64: memcpy(&kv->num.f64, &v, sizeof(v)); break;
        case GGUF_TYPE_BOOL: kv->num.u64 = v != 0; break;
        default: kv->num.u64 = v; break;
    }
}

static innerq_status gguf_read_array(struct gguf_reader * r, struct gguf_kv * kv) {
    uint32_t t;
    innerq_status st = reader_u32(r, "array element type", &t);
    if (st == INNERQ_OK) {
        st = reader_uint(r, 8, "array length", &kv->arr_n);
    }
    if (st != INNERQ_OK) {
        return st;
    }
    if (t >= GGUF_TYPE_COUNT) {
        return reader_fail(r, INNERQ_ERR_FORMAT, "unknown array element type %" PRIu32, t);
    }
    if (t == GGUF_TYPE_ARRAY) {
        return reader_fail(r, INNERQ_ERR_FORMAT, "arrays of arrays are not supported");
    }
    kv->arr_type = (enum gguf_vtype) t;
    // each element takes at least this many bytes (a string: its length field)
    const size_t min_size = t == GGUF_TYPE_STRING ? 8 : gguf_vtype_size[t];
    if (kv->arr_n > reader_left(r) / min_size) {
        return reader_fail(r, INNERQ_ERR_FORMAT,
                           "array of %" PRIu64 " %s values exceeds the file (%zu bytes left at offset %zu)",
                           kv->arr_n, gguf_vtype_name[t], reader_left(r), r->pos);
    }
    if (t != GGUF_TYPE_STRING) {
        const uint8_t * p;
        st = reader_take(r, (size_t) kv->arr_n * min_size, "array", &p);
        kv->arr_data = p;
        return st;
    }
    kv->arr_str = calloc(kv->arr_n ? (size_t) kv->arr_n : 1, sizeof(*kv->arr_str));
    if (kv->arr_str == NULL) {
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "%s: out of memory for an array of %" PRIu64 " strings",
                           r->path, kv->arr_n);
    }
    for (uint64_t i = 0; i < kv->arr_n && st == INNERQ_OK; i++) {
        st = reader_str(r, "array string", &kv->arr_str[i]);
    }
    return st;
}

static innerq_status gguf_read_kv(struct gguf_reader * r, struct gguf_impl * g, int64_t i) {
    struct gguf_kv * kv = &g->f.kv[i];
    snprintf(r->what, sizeof(r->what), "key #%" PRId64, i);
    innerq_status st = reader_name(r, "key", &kv->key);
    if (st != INNERQ_OK) {
        return st;
    }
    char q[96];
    gguf_quote(q, sizeof(q), kv->key, strlen(kv->key));
    snprintf(r->what, sizeof(r->what), "key '%s'", q);
    if (!gguf_index_add(&g->kv_index, kv->key, i)) {
        return reader_fail(r, INNERQ_ERR_FORMAT, "duplicate key");
    }
    uint32_t t;
    if ((st = reader_u32(r, "value type", &t)) != INNERQ_OK) {
        return st;
    }
    if (t >= GGUF_TYPE_COUNT) {
        return reader_fail(r, INNERQ_ERR_FORMAT, "unknown value type %" PRIu32, t);
    }
    kv->type = (enum gguf_vtype) t;
    if (t == GGUF_TYPE_STRING) {
        return reader_str(r, "string", &kv->str);
    }
    if (t == GGUF_TYPE_ARRAY) {
        return gguf_read_array(r, kv);
    }
    const uint8_t * p;
    if ((st = reader_take(r, gguf_vtype_size[t], "value", &p)) == INNERQ_OK) {
        gguf_num_decode(kv, kv->type, p);
    }
    return st;
}

// a * b into *out; false on overflow of the unsigned 64-bit range.
static bool gguf_mul(uint64_t a, uint64_t b, uint64_t * out) {
    if (a != 0 && b > UINT64_MAX / a) {
        return false;
    }
    *out = a * b;
    return true;
}

static void gguf_dims_text(char * dst, size_t dst_size, const uint64_t * ne, uint32_t n_dims) {
    size_t o = 0;
    for (uint32_t d = 0; d < n_dims && o < dst_size; d++) {
        o += (size_t) snprintf(dst + o, dst_size - o, d ? " x %" PRIu64 : "%" PRIu64, ne[d]);
    }
}

// Shape and type of a tensor info: dims positive, element count and size within 64 bits,
// rows whole blocks.
static innerq_status gguf_check_shape(struct gguf_reader * r, struct gguf_tensor_info * ti, const uint64_t * ne,
                                      uint32_t type) {
    char dims[128];
    gguf_dims_text(dims, sizeof(dims), ne, ti->n_dims);
    uint64_t n = 1;
    for (uint32_t d = 0; d < ti->n_dims; d++) {
        if (ne[d] == 0) {
            return reader_fail(r, INNERQ_ERR_FORMAT, "dims %s: a dimension is zero", dims);
        }
        if (ne[d] > INT64_MAX || !gguf_mul(n, ne[d], &n) || n > INT64_MAX) {
            return reader_fail(r, INNERQ_ERR_FORMAT, "dims %s: the element count overflows 64 bits", dims);
        }
        ti->ne[d] = (int64_t) ne[d];
    }
    const struct iq_type_traits * tr =
        type < IQ_TYPE_GGUF_END && iq_type_is_valid((int) type) ? iq_type_traits_get((enum iq_type) type) : NULL;
    if (tr == NULL) {
        const size_t n_foreign = sizeof(gguf_foreign_type_name) / sizeof(gguf_foreign_type_name[0]);
        if (type < n_foreign && gguf_foreign_type_name[type]) {
            return reader_fail(r, INNERQ_ERR_UNSUPPORTED, "type %s (%" PRIu32 ") is not supported",
                               gguf_foreign_type_name[type], type);
        }
        return reader_fail(r, INNERQ_ERR_FORMAT, "unknown type %" PRIu32, type);
    }
    ti->type = (enum iq_type) type;
    if (ne[0] % (uint64_t) tr->blck_size != 0) {
        return reader_fail(r, INNERQ_ERR_FORMAT,
                           "row of %" PRIu64 " elements is not a multiple of the %s block size %" PRId64,
                           ne[0], tr->name, tr->blck_size);
    }
    uint64_t size;
    if (!gguf_mul(ne[0] / (uint64_t) tr->blck_size, tr->type_size, &size) ||
        !gguf_mul(size, n / ne[0], &size) || size > SIZE_MAX) {
        return reader_fail(r, INNERQ_ERR_FORMAT, "dims %s of %s: the size in bytes overflows", dims, tr->name);
    }
    ti->size = (size_t) size;
    return INNERQ_OK;
}

static innerq_status gguf_read_tensor(struct gguf_reader * r, struct gguf_impl * g, int64_t i) {
    struct gguf_tensor_info * ti = &g->f.tensors[i];
    snprintf(r->what, sizeof(r->what), "tensor #%" PRId64, i);
    innerq_status st = reader_name(r, "name", &ti->name);
    if (st != INNERQ_OK) {
        return st;
    }
    char q[96];
    const size_t len = strlen(ti->name);
    gguf_quote(q, sizeof(q), ti->name, len);
    snprintf(r->what, sizeof(r->what), "tensor '%s'", q);
    if (len >= IQ_MAX_NAME) {
        return reader_fail(r, INNERQ_ERR_FORMAT, "name of %zu bytes is too long (at most %d)", len, IQ_MAX_NAME - 1);
    }
    if (!gguf_index_add(&g->tensor_index, ti->name, i)) {
        return reader_fail(r, INNERQ_ERR_FORMAT, "duplicate tensor name");
    }
    if ((st = reader_u32(r, "n_dims", &ti->n_dims)) != INNERQ_OK) {
        return st;
    }
    if (ti->n_dims < 1 || ti->n_dims > IQ_MAX_DIMS) {
        return reader_fail(r, INNERQ_ERR_FORMAT, "n_dims %" PRIu32 " is not in 1..%d", ti->n_dims, IQ_MAX_DIMS);
    }
    uint64_t ne[IQ_MAX_DIMS] = { 1, 1, 1, 1 };
    for (uint32_t d = 0; d < ti->n_dims && st == INNERQ_OK; d++) {
        st = reader_uint(r, 8, "dimension", &ne[d]);
    }
    uint32_t type;
    if (st == INNERQ_OK) {
        st = reader_u32(r, "type", &type);
    }
    if (st == INNERQ_OK) {
        st = reader_uint(r, 8, "offset", &ti->offset);
    }
    if (st != INNERQ_OK) {
        return st;
    }
    for (int d = 0; d < IQ_MAX_DIMS; d++) {
        ti->ne[d] = 1;
    }
    if ((st = gguf_check_shape(r, ti, ne, type)) != INNERQ_OK) {
        return st;
    }
    if (ti->offset % g->f.alignment != 0) {
        return reader_fail(r, INNERQ_ERR_FORMAT, "offset %" PRIu64 " is not a multiple of the alignment %zu",
                           ti->offset, g->f.alignment);
    }
    return INNERQ_OK;
}

static innerq_status gguf_read_alignment(struct gguf_reader * r, struct gguf_file * f) {
    innerq_status st = INNERQ_OK;
    uint32_t a = GGUF_DEFAULT_ALIGNMENT;
    if (!gguf_get_u32(f, "general.alignment", &a, &st) && st != INNERQ_OK) {
        return reader_fail(r, st, "%s", iq_error_get());
    }
    if (a == 0 || (a & (a - 1)) != 0) {
        return reader_fail(r, INNERQ_ERR_FORMAT, "general.alignment %" PRIu32 " is not a power of 2", a);
    }
    f->alignment = a;
    return INNERQ_OK;
}

static int gguf_cmp_offset(const void * a, const void * b) {
    const struct gguf_tensor_info * x = *(const struct gguf_tensor_info * const *) a;
    const struct gguf_tensor_info * y = *(const struct gguf_tensor_info * const *) b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

// Every tensor's bytes inside the data section, no two sharing a byte; sets their addresses.
static innerq_status gguf_place_tensors(struct gguf_reader * r, struct gguf_file * f) {
    for (int64_t i = 0; i < f->n_tensors; i++) {
        struct gguf_tensor_info * ti = &f->tensors[i];
        if (ti->offset > f->data_size || ti->size > f->data_size - ti->offset) {
            char q[96], end[48];
            gguf_quote(q, sizeof(q), ti->name, strlen(ti->name));
            // offset + size, which may not fit 64 bits
            snprintf(end, sizeof(end), ti->offset <= UINT64_MAX - ti->size ? "%" PRIu64 : "%" PRIu64 " + %zu",
                     ti->offset <= UINT64_MAX - ti->size ? ti->offset + ti->size : ti->offset, ti->size);
            return innerq_fail(INNERQ_ERR_FORMAT,
                               "%s: tensor '%s': data [%" PRIu64 ", %s) lies outside the file "
                               "(size %zu; the data section starts at %zu)",
                               r->path, q, ti->offset, end, r->size, f->data_offset);
        }
        // the element or block structs are read in place: their address must suit their
        // fields (a power of two that divides the block's bytes, at most 8), which a file whose
        // general.alignment is below that may not give
        const size_t tsize = iq_type_traits_get(ti->type)->type_size;
        const size_t need = tsize % 8 == 0 ? 8 : tsize % 4 == 0 ? 4 : tsize % 2 == 0 ? 2 : 1;
        if ((f->data_offset + ti->offset) % need != 0) {
            char q[96];
            gguf_quote(q, sizeof(q), ti->name, strlen(ti->name));
            return innerq_fail(INNERQ_ERR_FORMAT,
                               "%s: tensor '%s': data at file offset %" PRIu64 " is not a multiple of %zu, the "
                               "alignment its type needs (general.alignment %zu)",
                               r->path, q, (uint64_t) f->data_offset + ti->offset, need, f->alignment);
        }
        ti->data = (uint8_t *) f->data + ti->offset;
    }
    if (f->n_tensors < 2) {
        return INNERQ_OK;
    }
    const struct gguf_tensor_info ** order = malloc((size_t) f->n_tensors * sizeof(*order));
    if (order == NULL) {
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "%s: out of memory", r->path);
    }
    for (int64_t i = 0; i < f->n_tensors; i++) {
        order[i] = &f->tensors[i];
    }
    qsort(order, (size_t) f->n_tensors, sizeof(*order), gguf_cmp_offset);
    innerq_status st = INNERQ_OK;
    for (int64_t i = 1; i < f->n_tensors && st == INNERQ_OK; i++) {
        const struct gguf_tensor_info * a = order[i - 1], * b = order[i];
        if (a->offset + a->size > b->offset) {
            char qa[96], qb[96];
            gguf_quote(qa, sizeof(qa), a->name, strlen(a->name));
            gguf_quote(qb, sizeof(qb), b->name, strlen(b->name));
            st = innerq_fail(INNERQ_ERR_FORMAT,
                             "%s: the data of tensors '%s' [%" PRIu64 ", %" PRIu64 ") and '%s' [%" PRIu64 ", %" PRIu64
                             ") overlap",
                             r->path, qa, a->offset, a->offset + a->size, qb, b->offset, b->offset + b->size);
        }
    }
    free(order);
    return st;
}

static innerq_status gguf_read_header(struct gguf_reader * r, struct gguf_impl * g) {
    struct gguf_file * f = &g->f;
    const uint8_t * magic;
    innerq_status st = reader_take(r, 4, "magic", &magic);
    if (st != INNERQ_OK) {
        return st;
    }
    if (memcmp(magic, "GGUF", 4) != 0) {
        char q[48];
        gguf_quote(q, sizeof(q), (const char *) magic, 4);
        return reader_fail(r, INNERQ_ERR_FORMAT, "bad magic '%s', not a GGUF file", q);
    }
    if ((st = reader_u32(r, "version", &f->version)) != INNERQ_OK) {
        return st;
    }
    if (f->version == 1) {
        return reader_fail(r, INNERQ_ERR_UNSUPPORTED,
                           "GGUF version 1 is not supported (only 2 and 3): convert the model again");
    }
    if (f->version == 0x02000000u || f->version == 0x03000000u) {
        return reader_fail(r, INNERQ_ERR_UNSUPPORTED, "big-endian GGUF files are not supported");
    }
    if (f->version != 2 && f->version != 3) {
        return reader_fail(r, f->version == 0 ? INNERQ_ERR_FORMAT : INNERQ_ERR_UNSUPPORTED,
                           "GGUF version %" PRIu32 " is not supported (only 2 and 3)", f->version);
    }
    uint64_t n_tensors, n_kv;
    if ((st = reader_uint(r, 8, "tensor count", &n_tensors)) != INNERQ_OK ||
        (st = reader_uint(r, 8, "key/value count", &n_kv)) != INNERQ_OK) {
        return st;
    }
    const size_t left = reader_left(r);
    if (n_tensors > left / GGUF_MIN_TENSOR_BYTES) {
        return reader_fail(r, INNERQ_ERR_FORMAT,
                           "tensor count %" PRIu64 " is absurd: the %zu bytes after the header hold at most %zu",
                           n_tensors, left, left / GGUF_MIN_TENSOR_BYTES);
    }
    const size_t kv_max = (left - (size_t) n_tensors * GGUF_MIN_TENSOR_BYTES) / GGUF_MIN_KV_BYTES;
    if (n_kv > kv_max) {
        return reader_fail(r, INNERQ_ERR_FORMAT,
                           "key/value count %" PRIu64 " is absurd: the %zu bytes after the header hold at most %zu",
                           n_kv, left, kv_max);
    }
    f->n_kv = (int64_t) n_kv;
    f->n_tensors = (int64_t) n_tensors;
    f->kv = calloc(n_kv ? (size_t) n_kv : 1, sizeof(*f->kv));
    f->tensors = calloc(n_tensors ? (size_t) n_tensors : 1, sizeof(*f->tensors));
    if (f->kv == NULL || f->tensors == NULL || !gguf_index_init(&g->kv_index, f->n_kv) ||
        !gguf_index_init(&g->tensor_index, f->n_tensors)) {
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "%s: out of memory for %" PRIu64 " keys and %" PRIu64 " tensors",
                           r->path, n_kv, n_tensors);
    }
    for (int64_t i = 0; i < f->n_kv && st == INNERQ_OK; i++) {
        st = gguf_read_kv(r, g, i);
    }
    r->what[0] = '\0';
    if (st == INNERQ_OK) {
        st = gguf_read_alignment(r, f);
    }
    for (int64_t i = 0; i < f->n_tensors && st == INNERQ_OK; i++) {
        st = gguf_read_tensor(r, g, i);
    }
    r->what[0] = '\0';
    if (st != INNERQ_OK) {
        return st;
    }
    f->data_offset = r->pos + (f->alignment - r->pos % f->alignment) % f->alignment;
    f->data_size = r->size > f->data_offset ? r->size - f->data_offset : 0;
    f->data = (uint8_t *) r->base + (f->data_size ? f->data_offset : r->size);
    return gguf_place_tensors(r, f);
}

// ---- the file ----

static innerq_status gguf_read_all(int fd, const char * path, void * buf, size_t size) {
    size_t done = 0;
    while (done < size) {
        ssize_t n = read(fd, (uint8_t *) buf + done, size - done > (1u << 30) ? (1u << 30) : size - done);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            return innerq_fail(INNERQ_ERR_IO, "%s: read failed at byte %zu of %zu: %s", path, done, size,
                               n < 0 ? strerror(errno) : "unexpected end of file");
        }
        done += (size_t) n;
    }
    return INNERQ_OK;
}

// Maps or reads the whole file into f (map or buf); sets *base and *size. A mapped file stays
// open (f->fd).
static innerq_status gguf_load_file(const char * path, bool use_mmap, struct gguf_file * f,
                                    const uint8_t ** base, size_t * size) {
    // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever; the
    // check below then turns away everything that is not a regular file. It changes nothing
    // for a regular file's reads.
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        return innerq_fail(INNERQ_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    }
    struct stat sb;
    innerq_status st = INNERQ_OK;
    if (fstat(fd, &sb) != 0) {
        st = innerq_fail(INNERQ_ERR_IO, "%s: cannot stat: %s", path, strerror(errno));
    } else if (!S_ISREG(sb.st_mode)) {
        st = innerq_fail(INNERQ_ERR_IO, "%s: %s", path, S_ISDIR(sb.st_mode) ? "is a directory" : "not a regular file");
    } else if (sb.st_size == 0) {
        st = innerq_fail(INNERQ_ERR_FORMAT, "%s: empty file, not a GGUF file", path);
    } else if ((uint64_t) sb.st_size > SIZE_MAX) {
        st = innerq_fail(INNERQ_ERR_UNSUPPORTED, "%s: file too large for this machine", path);
    }
    *size = (size_t) sb.st_size;
    if (st == INNERQ_OK && use_mmap) {
        void * p = mmap(NULL, *size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) {
            st = innerq_fail(INNERQ_ERR_IO, "%s: mmap failed: %s", path, strerror(errno));
        } else {
            f->map = p;
            f->map_size = *size;
            f->fd = fd;
            *base = p;
        }
    } else if (st == INNERQ_OK) {
        // aligned so that tensor data keeps the file's alignment (up to 64) in memory
        if (posix_memalign(&f->buf, 64, *size) != 0) {
            f->buf = NULL;
            st = innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "%s: out of memory reading %zu bytes", path, *size);
        } else {
            st = gguf_read_all(fd, path, f->buf, *size);
            *base = f->buf;
        }
    }
    f->size = *size;
    if (f->fd != fd) {
        close(fd);
    }
    return st;
}

innerq_status gguf_open(const char * path, bool use_mmap, struct gguf_file ** out) {
    if (path == NULL || out == NULL) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "gguf_open: path and out must not be NULL");
    }
    *out = NULL;
    struct gguf_impl * g = calloc(1, sizeof(*g));
    if (g == NULL) {
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    }
    g->f.alignment = GGUF_DEFAULT_ALIGNMENT;
    g->f.fd = -1;
    g->f.n_parts = 1;
    struct gguf_reader r = { .path = path };
    innerq_status st = gguf_load_file(path, use_mmap, &g->f, &r.base, &r.size);
    if (st == INNERQ_OK) {
        st = gguf_read_header(&r, g);
    }
    if (st != INNERQ_OK) {
        gguf_close(&g->f);
        return st;
    }
    *out = &g->f;
    return INNERQ_OK;
}

void gguf_close(struct gguf_file * f) {
    if (f == NULL) {
        return;
    }
    struct gguf_impl * g = (struct gguf_impl *) f;
    for (int64_t i = 0; f->kv && i < f->n_kv; i++) {
        free(f->kv[i].key);
        free(f->kv[i].arr_str);
    }
    for (int64_t i = 0; f->tensors && i < f->n_tensors; i++) {
        free(f->tensors[i].name);
    }
    for (int32_t i = 1; f->part != NULL && i < f->n_parts; i++) {
        gguf_close(f->part[i]);
    }
    free(f->part);
    free(f->kv);
    free(f->tensors);
    free(g->kv_index.slots);
    free(g->tensor_index.slots);
    if (f->map) {
        munmap(f->map, f->map_size);
    }
    if (f->fd >= 0) {
        close(f->fd);
    }
    free(f->buf);
    free(g);
}

// ---- models split over several files ----

#define GGUF_SPLIT_MAX 9999  // gguf-split's file names count to 99999; a sane bound on files opened

// The name of file i (from 0) of n of the split model whose first file is `first`
// (PREFIX-00001-of-NNNNN.gguf), in buf; false if `first` is not named so.
static bool gguf_split_name(const char * first, int32_t i, int32_t n, char * buf, size_t size) {
    char tail[32];
    snprintf(tail, sizeof(tail), "-%05d-of-%05d.gguf", 1, n);
    const size_t len = strlen(first), tl = strlen(tail);
    if (len <= tl || strcmp(first + len - tl, tail) != 0) {
        return false;
    }
    return snprintf(buf, size, "%.*s-%05d-of-%05d.gguf", (int) (len - tl), first, i + 1, n) < (int) size;
}

// The file's split.no and split.count (0 and 1 for a file of its own).
static innerq_status gguf_split_of(const struct gguf_file * f, const char * path, uint32_t * no, uint32_t * count) {
    innerq_status st = INNERQ_OK;
    *no = 0, *count = 1;
    gguf_get_u32(f, "split.no", no, &st);
    gguf_get_u32(f, "split.count", count, &st);
    if (st == INNERQ_OK && (*count < 1 || *count > GGUF_SPLIT_MAX || *no >= *count)) {
        st = innerq_fail(INNERQ_ERR_FORMAT, "%s: split.no %u of split.count %u", path, *no, *count);
    }
    return st;
}

// Gathers the tensors of f's parts into f (names copied), each with its part, and indexes them.
static innerq_status gguf_split_gather(struct gguf_file * f, const char * path) {
    struct gguf_impl * g = (struct gguf_impl *) f;
    int64_t total = 0;
    for (int32_t i = 0; i < f->n_parts; i++) {
        total += f->part[i]->n_tensors;
    }
    struct gguf_tensor_info * all = calloc((size_t) total, sizeof(*all));
    struct gguf_index ix = {0};
    if (all == NULL || !gguf_index_init(&ix, total)) {
        free(all);
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    }
    int64_t n = 0;
    innerq_status st = INNERQ_OK;
    for (int32_t i = 0; i < f->n_parts && st == INNERQ_OK; i++) {
        const struct gguf_file * p = f->part[i];
        for (int64_t t = 0; t < p->n_tensors && st == INNERQ_OK; t++, n++) {
            all[n] = p->tensors[t];
            all[n].part = i;
            if ((all[n].name = strdup(p->tensors[t].name)) == NULL) {
                st = innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
            } else if (!gguf_index_add(&ix, all[n].name, n)) {
                st = innerq_fail(INNERQ_ERR_FORMAT, "%s: tensor '%s' is in more than one file of the split model",
                                 path, all[n].name);
            }
        }
    }
    if (st != INNERQ_OK) {
        for (int64_t t = 0; t < n; t++) {
            free(all[t].name);
        }
        free(all);
        free(ix.slots);
        return st;
    }
    for (int64_t t = 0; t < f->n_tensors; t++) {
        free(f->tensors[t].name);
    }
    free(f->tensors);
    free(g->tensor_index.slots);
    f->tensors = all;
    f->n_tensors = total;
    g->tensor_index = ix;
    return INNERQ_OK;
}

innerq_status gguf_open_split(const char * path, bool use_mmap, struct gguf_file ** out) {
    struct gguf_file * f = NULL;
    *out = NULL;
    innerq_status st = gguf_open(path, use_mmap, &f);
    uint32_t no = 0, count = 1;
    if (st == INNERQ_OK) {
        st = gguf_split_of(f, path, &no, &count);
    }
    if (st == INNERQ_OK && no != 0) {
        st = innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "%s is file %u of %u of a split model: open the first "
                         "(...-00001-of-%05u.gguf)", path, no + 1, count, count);
    }
    char name[4096];
    if (st == INNERQ_OK && count > 1 && !gguf_split_name(path, 0, (int32_t) count, name, sizeof(name))) {
        st = innerq_fail(INNERQ_ERR_FORMAT, "%s: split.count %u, but the name does not end in -00001-of-%05u.gguf "
                         "(the files of a split model are found by their names)", path, count, count);
    }
    if (st == INNERQ_OK && count > 1) {
        f->part = calloc(count, sizeof(*f->part));
        if (f->part == NULL) {
            st = innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
        } else {
            f->part[0] = f;
            f->n_parts = (int32_t) count;
        }
    }
    for (int32_t i = 1; st == INNERQ_OK && i < f->n_parts; i++) {
        gguf_split_name(path, i, f->n_parts, name, sizeof(name));
        uint32_t no_i = 0, count_i = 1;
        if ((st = gguf_open(name, use_mmap, &f->part[i])) == INNERQ_OK &&
            (st = gguf_split_of(f->part[i], name, &no_i, &count_i)) == INNERQ_OK &&
            (no_i != (uint32_t) i || count_i != count)) {
            st = innerq_fail(INNERQ_ERR_FORMAT, "%s: split.no %u of %u where file %d of %u was expected", name, no_i,
                             count_i, i + 1, count);
        }
    }
    if (st == INNERQ_OK && f->n_parts > 1) {
        st = gguf_split_gather(f, path);
    }
    uint32_t listed = 0;
    if (st == INNERQ_OK && f->n_parts > 1 && gguf_get_u32(f, "split.tensors.count", &listed, &st) &&
        st == INNERQ_OK && (int64_t) listed != f->n_tensors) {
        st = innerq_fail(INNERQ_ERR_FORMAT, "%s: split.tensors.count is %u, the %d files hold %lld", path, listed,
                         f->n_parts, (long long) f->n_tensors);
    }
    if (st != INNERQ_OK) {
        gguf_close(f);
        return st;
    }
    *out = f;
    return INNERQ_OK;
}

// ---- hashing: XXH64 (github.com/Cyan4973/xxHash), streamed in chunks of a multiple of 32 bytes ----

#define XXH_P1 0x9E3779B185EBCA87ull
#define XXH_P2 0xC2B2AE3D27D4EB4Full
#define XXH_P3 0x165667B19E3779F9ull
#define XXH_P4 0x85EBCA77C2B2AE63ull
#define XXH_P5 0x27D4EB2F165667C5ull
#define GGUF_HASH_CHUNK ((size_t) 1 << 20)
#define GGUF_HASH_PROGRESS ((size_t) 16 << 20)

static inline uint64_t xxh_rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
static inline uint64_t xxh_round(uint64_t acc, uint64_t in) { return xxh_rotl(acc + in * XXH_P2, 31) * XXH_P1; }
static inline uint64_t xxh_merge(uint64_t h, uint64_t v) { return (h ^ xxh_round(0, v)) * XXH_P1 + XXH_P4; }

static inline uint64_t xxh_read64(const uint8_t * p) {
    uint64_t v;
    memcpy(&v, p, sizeof(v));  // little-endian targets only, as the GGUF reader
    return v;
}

// The four lanes over n bytes, n a multiple of 32.
static void xxh_lanes(uint64_t v[4], const uint8_t * p, size_t n) {
    for (size_t i = 0; i < n; i += 32) {
        v[0] = xxh_round(v[0], xxh_read64(p + i));
        v[1] = xxh_round(v[1], xxh_read64(p + i + 8));
        v[2] = xxh_round(v[2], xxh_read64(p + i + 16));
        v[3] = xxh_round(v[3], xxh_read64(p + i + 24));
    }
}

// The digest of `total` bytes: lanes over the first total / 32 * 32, then the tail p[0, n).
static uint64_t xxh_finish(const uint64_t v[4], uint64_t total, const uint8_t * p, size_t n) {
    uint64_t h = total >= 32 ? xxh_rotl(v[0], 1) + xxh_rotl(v[1], 7) + xxh_rotl(v[2], 12) + xxh_rotl(v[3], 18)
                             : XXH_P5;
    if (total >= 32) {
        for (int i = 0; i < 4; i++) {
            h = xxh_merge(h, v[i]);
        }
    }
    h += total;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        h = xxh_rotl(h ^ xxh_round(0, xxh_read64(p + i)), 27) * XXH_P1 + XXH_P4;
    }
    if (i + 4 <= n) {
        uint32_t w;
        memcpy(&w, p + i, sizeof(w));
        h = xxh_rotl(h ^ (uint64_t) w * XXH_P1, 23) * XXH_P2 + XXH_P3;
        i += 4;
    }
    for (; i < n; i++) {
        h = xxh_rotl(h ^ p[i] * XXH_P5, 11) * XXH_P1;
    }
    h ^= h >> 33;
    h *= XXH_P2;
    h ^= h >> 29;
    h *= XXH_P3;
    return h ^ (h >> 32);
}

innerq_status gguf_file_hash(const struct gguf_file * f, bool (*progress)(float fraction, void * user), void * user,
                        uint64_t * out) {
    uint64_t v[4] = { XXH_P1 + XXH_P2, XXH_P2, 0, -XXH_P1 };
    uint8_t * chunk = f->fd >= 0 ? malloc(GGUF_HASH_CHUNK) : NULL;
    if (f->fd >= 0 && chunk == NULL) {
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory hashing the model file");
    }
    innerq_status st = INNERQ_OK;
    size_t done = 0, reported = 0;
    const uint8_t * p = f->buf;
    for (;;) {
        size_t n = f->size - done < GGUF_HASH_CHUNK ? f->size - done : GGUF_HASH_CHUNK;
        if (chunk != NULL) {
            size_t got = 0;
            while (got < n) {
                const ssize_t r = pread(f->fd, chunk + got, n - got, (off_t) (done + got));
                if (r < 0 && errno == EINTR) {
                    continue;
                }
                if (r <= 0) {
                    st = r < 0 ? innerq_fail(INNERQ_ERR_IO, "read failed at byte %zu: %s", done + got, strerror(errno))
                               : innerq_fail(INNERQ_ERR_FORMAT, "the file ends at byte %zu, not %zu as when it was "
                                             "opened: it was cut short while loading", done + got, f->size);
                    break;
                }
                got += (size_t) r;
            }
            p = chunk;
        } else {
            p = (const uint8_t *) f->buf + done;
        }
        if (st != INNERQ_OK || n < GGUF_HASH_CHUNK) {
            break;
        }
        xxh_lanes(v, p, n);
        done += n;
        if (progress != NULL && done - reported >= GGUF_HASH_PROGRESS) {
            reported = done;
            if (!progress((float) done / (float) f->size, user)) {
                st = innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "model loading cancelled");
                break;
            }
        }
    }
    if (st == INNERQ_OK) {
        const size_t n = f->size - done, whole = n / 32 * 32;
        xxh_lanes(v, p, whole);
        *out = xxh_finish(v, f->size, p + whole, n - whole);
    }
    free(chunk);
    return st;
}

// ---- lookups ----

const struct gguf_kv * gguf_find_kv(const struct gguf_file * f, const char * key) {
    if (f == NULL || key == NULL) {
        return NULL;
    }
    const int64_t i = gguf_index_find(&((const struct gguf_impl *) f)->kv_index, key);
    return i < 0 ? NULL : &f->kv[i];
}

const struct gguf_tensor_info * gguf_find_tensor(const struct gguf_file * f, const char * name) {
    if (f == NULL || name == NULL) {
        return NULL;
    }
    const int64_t i = gguf_index_find(&((const struct gguf_impl *) f)->tensor_index, name);
    return i < 0 ? NULL : &f->tensors[i];
}

static bool gguf_vtype_is_signed(enum gguf_vtype t) {
    return t == GGUF_TYPE_INT8 || t == GGUF_TYPE_INT16 || t == GGUF_TYPE_INT32 || t == GGUF_TYPE_INT64;
}

static bool gguf_vtype_is_unsigned(enum gguf_vtype t) {
    return t == GGUF_TYPE_UINT8 || t == GGUF_TYPE_UINT16 || t == GGUF_TYPE_UINT32 || t == GGUF_TYPE_UINT64;
}

// The getters leave *status alone on success so that a caller can check once after several.
static bool gguf_get_fail(const struct gguf_kv * kv, innerq_status * status, const char * want) {
    innerq_fail(INNERQ_ERR_FORMAT, "key '%s': a value of type %s can't be read as %s", kv->key,
                gguf_vtype_name[kv->type], want);
    if (status) {
        *status = INNERQ_ERR_FORMAT;
    }
    return false;
}

bool gguf_get_u32(const struct gguf_file * f, const char * key, uint32_t * out, innerq_status * status) {
    const struct gguf_kv * kv = gguf_find_kv(f, key);
    if (kv == NULL) {
        return false;
    }
    const bool in_range = (gguf_vtype_is_unsigned(kv->type) && kv->num.u64 <= UINT32_MAX) ||
                          (gguf_vtype_is_signed(kv->type) && kv->num.i64 >= 0 && kv->num.i64 <= (int64_t) UINT32_MAX);
    if (!in_range) {
        return gguf_get_fail(kv, status, gguf_vtype_is_unsigned(kv->type) || gguf_vtype_is_signed(kv->type)
                                             ? "uint32 (the value is out of range)" : "uint32");
    }
    *out = (uint32_t) kv->num.u64;
    return true;
}

bool gguf_get_f32(const struct gguf_file * f, const char * key, float * out, innerq_status * status) {
    const struct gguf_kv * kv = gguf_find_kv(f, key);
    if (kv == NULL) {
        return false;
    }
    if (kv->type == GGUF_TYPE_FLOAT32 || kv->type == GGUF_TYPE_FLOAT64) {
        *out = (float) kv->num.f64;
    } else if (gguf_vtype_is_signed(kv->type)) {
        *out = (float) kv->num.i64;
    } else if (gguf_vtype_is_unsigned(kv->type)) {
        *out = (float) kv->num.u64;
    } else {
        return gguf_get_fail(kv, status, "float32");
    }
    return true;
}

bool gguf_get_bool(const struct gguf_file * f, const char * key, bool * out, innerq_status * status) {
    const struct gguf_kv * kv = gguf_find_kv(f, key);
    if (kv == NULL) {
        return false;
    }
    if (kv->type != GGUF_TYPE_BOOL) {
        return gguf_get_fail(kv, status, "bool");
    }
    *out = kv->num.u64 != 0;
    return true;
}

bool gguf_get_str(const struct gguf_file * f, const char * key, struct gguf_str * out, innerq_status * status) {
    const struct gguf_kv * kv = gguf_find_kv(f, key);
    if (kv == NULL) {
        return false;
    }
    if (kv->type != GGUF_TYPE_STRING) {
        return gguf_get_fail(kv, status, "string");
    }
    *out = kv->str;
    return true;
}

const struct gguf_kv * gguf_get_arr(const struct gguf_file * f, const char * key, enum gguf_vtype type,
                                    innerq_status * status) {
    const struct gguf_kv * kv = gguf_find_kv(f, key);
    if (kv == NULL) {
        return NULL;
    }
    if (kv->type != GGUF_TYPE_ARRAY || kv->arr_type != type) {
        char want[32];
        snprintf(want, sizeof(want), "an array of %s", (unsigned) type < GGUF_TYPE_COUNT ? gguf_vtype_name[type] : "?");
        gguf_get_fail(kv, status, want);
        return NULL;
    }
    return kv;
}

// ---- values as text ----

// Text that is cut to fit buf but counts every byte, like snprintf.
struct gguf_text {
    char * buf;
    size_t size;
    size_t len;
};

static void text_put(struct gguf_text * t, const char * s, size_t n) {
    if (t->len + 1 < t->size) {
        const size_t room = t->size - 1 - t->len;
        memcpy(t->buf + t->len, s, n < room ? n : room);
    }
    t->len += n;
}

static void text_float(struct gguf_text * t, double v, bool is_f32) {
    // whole numbers as such (a rope base of 100000, not 1e+05), others as the shortest text
    // that reads back as the same value
    char s[40];
    if (v > -1e15 && v < 1e15 && v == (double) (int64_t) v) {
        snprintf(s, sizeof(s), "%.0f", v);
        text_put(t, s, strlen(s));
        return;
    }
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(s, sizeof(s), "%.*g", prec, v);
        if (is_f32 ? strtof(s, NULL) == (float) v : strtod(s, NULL) == v) {
            break;
        }
    }
    text_put(t, s, strlen(s));
}

static void text_scalar(struct gguf_text * t, const struct gguf_kv * kv) {
    char s[32];
    if (kv->type == GGUF_TYPE_FLOAT32 || kv->type == GGUF_TYPE_FLOAT64) {
        text_float(t, kv->num.f64, kv->type == GGUF_TYPE_FLOAT32);
        return;
    }
    if (kv->type == GGUF_TYPE_BOOL) {
        snprintf(s, sizeof(s), "%s", kv->num.u64 ? "true" : "false");
    } else if (gguf_vtype_is_signed(kv->type)) {
        snprintf(s, sizeof(s), "%" PRId64, kv->num.i64);
    } else {
        snprintf(s, sizeof(s), "%" PRIu64, kv->num.u64);
    }
    text_put(t, s, strlen(s));
}

#define GGUF_TEXT_MAX_ELEMENTS 8

static void text_array(struct gguf_text * t, const struct gguf_kv * kv) {
    char s[48];
    if (kv->arr_type == GGUF_TYPE_STRING) {
        snprintf(s, sizeof(s), "[%" PRIu64 " string%s]", kv->arr_n, kv->arr_n == 1 ? "" : "s");
        text_put(t, s, strlen(s));
        return;
    }
    text_put(t, "[", 1);
    const size_t esize = gguf_vtype_size[kv->arr_type];
    for (uint64_t i = 0; i < kv->arr_n && i < GGUF_TEXT_MAX_ELEMENTS; i++) {
        struct gguf_kv e = { 0 };
        gguf_num_decode(&e, kv->arr_type, (const uint8_t *) kv->arr_data + i * esize);
        if (i) {
            text_put(t, ", ", 2);
        }
        text_scalar(t, &e);
    }
    if (kv->arr_n > GGUF_TEXT_MAX_ELEMENTS) {
        snprintf(s, sizeof(s), ", ... (%" PRIu64 " values)", kv->arr_n);
        text_put(t, s, strlen(s));
    }
    text_put(t, "]", 1);
}

int32_t gguf_kv_to_text(const struct gguf_kv * kv, char * buf, size_t buf_size) {
    if (kv == NULL) {
        return -1;
    }
    struct gguf_text t = { buf, buf_size, 0 };
    if (kv->type == GGUF_TYPE_STRING) {
        text_put(&t, kv->str.data, (size_t) kv->str.n);
    } else if (kv->type == GGUF_TYPE_ARRAY) {
        text_array(&t, kv);
    } else {
        text_scalar(&t, kv);
    }
    if (buf_size > 0) {
        buf[t.len < buf_size ? t.len : buf_size - 1] = '\0';
    }
    return t.len > INT32_MAX ? INT32_MAX : (int32_t) t.len;
}
