// The posenc operator library, reached from Python as torch.ops.posenc.* and from C++
// through the functions of the public headers (posenc/posenc.h). Each family defines its
// schemas in its <family>.cpp (TORCH_LIBRARY_FRAGMENT(posenc, m), beside the one reader of
// their arguments and their kernels); this block only declares the namespace. Registration
// order does not matter: the dispatcher takes a fragment's schemas and any file's kernels
// (TORCH_LIBRARY_IMPL) in whatever order the static initialisers run.
#include <torch/library.h>

TORCH_LIBRARY(posenc, m) {}
