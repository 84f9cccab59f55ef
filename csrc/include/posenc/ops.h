// Umbrella header of posenc's op functions (kept for the code that includes it): each family
// declares its own in posenc/<family>.h.
#pragma once

#include "posenc/add_position.h"
#include "posenc/sinusoidal_table.h"
