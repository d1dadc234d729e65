// Included by every private header of the project (base/, serialize/, ipc/, net/): they are
// reached through meson's `private_dep` alone, which defines TENSORBUCKET_PRIVATE, so nothing
// built against the public headers (a user's program, the examples) leans on them by accident.
#pragma once

#ifndef TENSORBUCKET_PRIVATE
#error "a private tensorbucket header: the public API is include/tensorbucket/ (in the project, depend on private_dep)"
#endif
