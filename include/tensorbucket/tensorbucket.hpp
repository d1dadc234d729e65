// tensorbucket: move many named tensors between processes as one verified, zero-copy bucket.
// Include this header for the whole public API.
#pragma once

#include "tensorbucket/bucket.hpp"
#include "tensorbucket/channel.hpp"
#include "tensorbucket/deadline.hpp"
#include "tensorbucket/dtype.hpp"
#include "tensorbucket/error.hpp"
#include "tensorbucket/header.hpp"
#include "tensorbucket/manifest.hpp"
#include "tensorbucket/safetensors.hpp"
