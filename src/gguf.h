// GGUF reader. gguf_open validates the whole header up front (magic, version, counts, string
// and array lengths, tensor dims/types/offsets against the file size, alignment), so every
// accessor afterwards works on consistent data. Tensor data is used in place (mmap) or read
// into one allocation when mmap is off.
#pragma once

#include "innerq.h"
#include "iq-types.h"

enum gguf_vtype {
    GGUF_TYPE_UINT8 = 0, GGUF_TYPE_INT8 = 1, GGUF_TYPE_UINT16 = 2, GGUF_TYPE_INT16 = 3,
    GGUF_TYPE_UINT32 = 4, GGUF_TYPE_INT32 = 5, GGUF_TYPE_FLOAT32 = 6, GGUF_TYPE_BOOL = 7,
    GGUF_TYPE_STRING = 8, GGUF_TYPE_ARRAY = 9, GGUF_TYPE_UINT64 = 10, GGUF_TYPE_INT64 = 11,
    GGUF_TYPE_FLOAT64 = 12, GGUF_TYPE_COUNT,
};

struct gguf_str {
    uint64_t n;
    const char * data;  // points into the file; not NUL-terminated
};

struct gguf_kv {
    char * key;                 // NUL-terminated copy
    enum gguf_vtype type;
    // scalars (integers widened; bool as 0/1)
    union { uint64_t u64; int64_t i64; double f64; } num;
    struct gguf_str str;        // GGUF_TYPE_STRING
    enum gguf_vtype arr_type;   // GGUF_TYPE_ARRAY: element type
    uint64_t arr_n;             //   element count
    const void * arr_data;      //   numeric arrays: the raw little-endian elements in the file
    struct gguf_str * arr_str;  //   string arrays: arr_n strings
};

struct gguf_tensor_info {
    char * name;                // NUL-terminated copy
    uint32_t n_dims;
    int64_t ne[4];              // unused dims are 1
    enum iq_type type;
    uint64_t offset;            // from the start of its file's data section
    size_t size;                // bytes
    void * data;                // address of the data (in the mapping or the read buffer)
    int32_t part;               // the file of a split model that holds it (0: the first)
};

struct gguf_file {
    uint32_t version;
    int64_t n_kv;
    struct gguf_kv * kv;
    int64_t n_tensors;
    struct gguf_tensor_info * tensors;
    size_t alignment;
    size_t data_offset;         // start of the data section in the file
    size_t data_size;           // bytes from data_offset to the end of the file
    void * data;                // the data section (mapped or read)
    // private
    void * map;
    size_t map_size;
    void * buf;
    size_t size;                // bytes of the file when it was opened
    int fd;                     // the file, kept open while it is mapped (gguf_file_hash reads it); else -1
    // A model split over several files (gguf_open_split): the files in order, part[0] this one,
    // whose tensors are every file's (each with its part); metadata is the first file's.
    int32_t n_parts;
    struct gguf_file ** part;
};

innerq_status gguf_open(const char * path, bool use_mmap, struct gguf_file ** out);
// A model file, or the first file of a model split over several (llama.cpp's gguf-split:
// split.count files named PREFIX-NNNNN-of-MMMMM.gguf, split.no numbering them from 0): every
// file opened, each checked, and their tensors gathered in the first's (gguf_file.part). A
// later file named instead of the first, a missing or foreign file, or a tensor in two files is
// INNERQ_ERR_FORMAT / _IO with a message that names the file.
innerq_status gguf_open_split(const char * path, bool use_mmap, struct gguf_file ** out);
void gguf_close(struct gguf_file * f);

// XXH64 (seed 0) of the whole file as it was opened, read with pread when the file is mapped:
// a file cut short since gguf_open is then INNERQ_ERR_FORMAT, where a read of the mapping
// would end the process with SIGBUS. progress(fraction of the bytes, user) is called every
// 16 MiB; false from it cancels (INNERQ_ERR_INVALID_ARGUMENT). progress may be NULL.
innerq_status gguf_file_hash(const struct gguf_file * f, bool (*progress)(float fraction, void * user), void * user,
                        uint64_t * out);

const struct gguf_kv * gguf_find_kv(const struct gguf_file * f, const char * key);
const struct gguf_tensor_info * gguf_find_tensor(const struct gguf_file * f, const char * name);

// Typed getters: false if the key is absent; INNERQ_ERR_FORMAT (via *status) if present with
// a type that can't be read as asked (integers convert when in range).
bool gguf_get_u32(const struct gguf_file * f, const char * key, uint32_t * out, innerq_status * status);
bool gguf_get_f32(const struct gguf_file * f, const char * key, float * out, innerq_status * status);
bool gguf_get_bool(const struct gguf_file * f, const char * key, bool * out, innerq_status * status);
bool gguf_get_str(const struct gguf_file * f, const char * key, struct gguf_str * out, innerq_status * status);
// An array whose elements have type `type` (strings: out->arr_str).
const struct gguf_kv * gguf_get_arr(const struct gguf_file * f, const char * key, enum gguf_vtype type,
                                    innerq_status * status);

// Value as text (used for innerq_model_meta_value); returns bytes needed, like snprintf.
int32_t gguf_kv_to_text(const struct gguf_kv * kv, char * buf, size_t buf_size);
