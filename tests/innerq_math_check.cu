// Compiles every function of the shared InnerQ math header in device code.
#include "iq-qcache-math.h"

__global__ void iq_math_kernel(const float * x, float * y, uint8_t * u, iq_fp16_t * h, int8_t * q8) {
    iq_fp16_t d, m;
    h[0] = iq_float_to_half(x[0]);
    y[0] = iq_half_to_float(h[0]);
    y[1] = iq_exp_poly(-x[1]);
    y[2] = iq_round_even(x[2]);
    u[0] = iq_p8(x[3]);
    u[1] = iq_qtile_code(u + 8, 3, 5);
    iq_qtile_pack_codes(u + 64, 3, u + 128);
    int32_t t, c;
    iq_qtile_coords(true, 64, 32, 1, 7, &t, &c);
    u[2] = (uint8_t) (iq_qblock_group_of(false, 32, t, c) + iq_qblock_bytes(3, 64, 32) + iq_qblock_params_offset(2, 64, 32));
    u[3] = iq_quant_code(x[4], 0, 3, 0);
    iq_quant_asym_group(x, 32, 4, u + 200, &d, &m);
    iq_quant_sym_group(x, 32, 4, u + 200, &d, &m);
    y[3] = (float) iq_quant_l1_error(x, 32, u + 200, d, m);
    iq_quant_group_hd(x, 32, 3, 0, true, u + 200, h + 1, h + 2);
    iq_quant_codes(x, 32, 4, false, true, d, m, u + 200);
    y[6] = (float) iq_quant_l2_error(x, 32, u + 200, true, d, m) + iq_qsearch_factor(2) + iq_mulf(x[0], x[1]) +
           (float) iq_muld(x[2], x[3]);
    y[7] = (float) iq_quant_search_one(x, 32, 8, true, false, -1.0f, 1.0f, 1.0f, 0.84f, u + 200, &d, &m);
    iq_quant_search_group(x, 32, 4, false, u + 200, h + 3, h + 4);
    float sq, sumq, q2;
    iq_query_prep_group(x, x + 32, 32, true, q8, &sq, &sumq, &q2);
    float st[66], st2[66];
    iq_softmax_init(st, 64);
    iq_softmax_init(st2, 64);
    iq_softmax_add(st, 64, x[5], x);
    y[4] = iq_softmax_raise(st2, 64, x[6]);
    iq_softmax_merge(st, st2, 64);
    iq_softmax_finish(st, 64, y + 8);
    y[5] = sq + sumq + q2 + (float) iq_f32_bits(x[7]) + iq_f32_from_bits(7u);
    size_t first, step;
    int32_t c0;
    iq_qblock_group_span(true, 64, 32, 3, &first, &step, &c0);
    u[4] = (uint8_t) (first + step + c0);
    iq_qblock_quantize_group(h, false, 3, 64, 32, 3, true, x, x + 64, 5, u + 256, h + 4096, h + 4160);
    u[6] = iq_row_scale_code(x, 64);
    y[7] += iq_row_scale(u[6]) + (float) iq_qblock_bytes_with(2, 64, 32, true);
    iq_qblock_pack_tile(u + 256, true, 2, 64, 32, 1, u + 2304);
    u[5] = iq_qblock_code_at(u + 2304, false, 4, 64, 32, 3, 9);
    y[6] = iq_qcache_norm_of(x, 16, 5);
    u[7] = iq_p8_d_code(x[0], x[1]);
    y[6] += iq_p8_d_factor(u[7]) + iq_p8_rounded(x[2]);
    iq_p8_decode_block(u + 2304, 64, iq_grid_centre(8, true), h + 4224);
    u[8] = (uint8_t) (iq_qblock_params_bytes(64, IQ_QBLOCK_P8) +
                      iq_qblock_scales_offset(2, 64, 32, IQ_QBLOCK_ROW_SCALES) + iq_qblock_bytes_fmt(3, 64, 32, IQ_QBLOCK_P8));
    u[9] = (uint8_t) (iq_qblock_levels(3, IQ_QBLOCK_LEVELS) + iq_key_level(u[10]) + iq_key_level_code(x[9]));
    y[9] = iq_grid_level(true, u[11]);
    iq_qblock_group_values(h, true, 64, 32, x, x + 64, 2, y + 80);
    u[12] = iq_row_scale_code_ms(x[10]) + iq_row_scale_code_h(h, 64);
    float ref[3];
    iq_p8_refs(u + 2304, ref);
    iq_p8_decode_one(ref, u[13], u[14], 4.0f, &d, &m);
    iq_p8_decode_group(u + 2304, 64, 4.0f, 5, &d, &m);
    u[15] = (uint8_t) iq_p8_is_sym(d, m, 4.0f);
    h[5] = iq_half_up(x[11]);
    iq_p8_write_refs(h + 4224, h + 4288, 64, 4.0f, u + 2400);
    iq_p8_code_group(u + 2400, 64, 4.0f, 7, d, m);
    iq_qblock_recode_group(h, true, 3, false, 64, 32, x, x + 64, 6, true, d, m, u + 256);
}
