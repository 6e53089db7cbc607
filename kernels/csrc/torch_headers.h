// The torch headers every kernel file includes (through avx2_common.h). cpu_ops.py precompiles
// this file once per kernel cache and every file starts from it: parsing them took ~4.5 s of
// each file's 6-14 s of compiling.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
