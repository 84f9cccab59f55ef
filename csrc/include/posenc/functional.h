// posenc's functions (Python's posenc.functional), each declared in its family's header.
#pragma once

#include "posenc/add_position.h"      // add_position
#include "posenc/helpers.h"           // timestep_embedding, sinusoidal_2d_table, make_positions, ...
#include "posenc/qk_norm_rope.h"      // qk_norm_rope
#include "posenc/rope.h"              // apply_rope, apply_rope_cos_sin, rope_frequencies, ...
#include "posenc/rope_append_kv.h"    // rope_append_kv
#include "posenc/rope_shift_kv.h"     // rope_shift_kv_
#include "posenc/sinusoidal_table.h"  // sinusoidal_table
