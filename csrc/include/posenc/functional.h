// Umbrella header of the helper functions (kept for the code that includes it): they and
// the Timesteps module are declared in posenc/helpers.h.
#pragma once

#include "posenc/helpers.h"
