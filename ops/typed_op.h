// The C++ entry points' (hierpar/ops.h) handle on their registered op. Private to hierpar_ops.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

namespace hierpar::detail {

// The op `name` (e.g. "hierpar::conv2d") with `overload`, typed as the C++ function type F: an entry point keeps
// it in a function-local static, so the schema is looked up once.
template <typename F>
c10::TypedOperatorHandle<F> typed_op(const char* name, const char* overload = "") {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, overload).typed<F>();
}

}  // namespace hierpar::detail
