#!/usr/bin/env bash
# Fails when a hierpar shared library carries its own copy of the C++ runtime (libstdc++ linked statically):
# such a library crashes in a Python process on the first error message that formats a number.
#   tests/shared_cxx_runtime.sh LIBRARY...
status=0
for lib in "$@"; do
  # std::ostream::_M_insert<long> and std::locale's constructor live in libstdc++.so; a definition here means a private copy.
  copies=$(nm -D --defined-only "$lib" | grep -E " (_ZNSo9_M_insertIlEERSoT_|_ZNSt6localeC1Ev)$")
  if [ -n "$copies" ]; then
    echo "FAIL: $lib defines libstdc++'s own symbols (a static C++ runtime was linked in):"
    echo "$copies"
    status=1
  else
    echo "ok: $lib takes the C++ runtime from libstdc++.so ($(ldd "$lib" | grep -o 'libstdc++[^ ]* => [^ ]*'))"
  fi
done
exit $status
