// Build facts the Python loader checks before registering any handler: a library built
// against newer XLA FFI headers than the running jaxlib accepts must be refused with a
// clear message instead of failing later with "no handler registered".
#include "xla/ffi/api/c_api.h"

extern "C" {

// XLA FFI API version of the headers this library was compiled against.
int jax_twell_ffi_api_major() { return XLA_FFI_API_MAJOR; }
int jax_twell_ffi_api_minor() { return XLA_FFI_API_MINOR; }

// Bumped whenever a handler's signature (operands, results, attributes) or what it computes
// changes (15: the warp-per-token FFN handlers, attributes tile and max_entries), so the
// Python side never binds a stale library.
int jax_twell_abi_version() { return 20; }

}  // extern "C"
