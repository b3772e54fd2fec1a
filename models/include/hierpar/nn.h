// hierpar's drop-in layers: the same options types, parameter and buffer names as torch::nn, so a stock
// layer is swapped for one line and state dicts interchange; convert.h swaps a whole model's, in place.
#pragma once

#include "hierpar/nn/batch_norm.h"
#include "hierpar/nn/conv2d.h"
#include "hierpar/nn/conv_transpose.h"
#include "hierpar/nn/convert.h"
#include "hierpar/nn/max_pool.h"
