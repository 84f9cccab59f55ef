// Everything posenc offers to LibTorch applications.
#pragma once

#include "posenc/functional.h"
#include "posenc/modules.h"
#include "posenc/ops.h"
#include "posenc/qk_norm_rope.h"
#include "posenc/rope.h"
#include "posenc/rope_append_kv.h"
#include "posenc/rope_shift_kv.h"
