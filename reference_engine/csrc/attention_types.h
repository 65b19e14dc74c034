/* The attention kernel (attention_kernel.h) for each pair of KV cache element types, at the SIMD
 * level attention.c has set up (ATT_ISA its suffix): attend_rows<ATT_ISA>_ff, _fh, _hf and _hh,
 * keys' type then values' (f: f32, h: f16). */
#define ATT_KH 0
#define ATT_VH 0
#define ATT_NAME(x) ATT_CAT(x, ATT_CAT(ATT_ISA, _ff))
#include "attention_kernel.h"
#undef ATT_NAME
#undef ATT_VH
#define ATT_VH 1
#define ATT_NAME(x) ATT_CAT(x, ATT_CAT(ATT_ISA, _fh))
#include "attention_kernel.h"
#undef ATT_NAME
#undef ATT_KH
#undef ATT_VH
#define ATT_KH 1
#define ATT_VH 0
#define ATT_NAME(x) ATT_CAT(x, ATT_CAT(ATT_ISA, _hf))
#include "attention_kernel.h"
#undef ATT_NAME
#undef ATT_VH
#define ATT_VH 1
#define ATT_NAME(x) ATT_CAT(x, ATT_CAT(ATT_ISA, _hh))
#include "attention_kernel.h"
#undef ATT_NAME
#undef ATT_KH
#undef ATT_VH
