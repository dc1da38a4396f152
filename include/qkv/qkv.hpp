// qkv/qkv.hpp — the umbrella header: include this one.
#pragma once

#include "qkv/attention.hpp"
#include "qkv/config.hpp"
#include "qkv/errors.hpp"
#include "qkv/inspect.hpp"
#include "qkv/isa.hpp"
#include "qkv/mask.hpp"
#include "qkv/multi_head.hpp"
#include "qkv/options.hpp"
#include "qkv/positional.hpp"
#include "qkv/reference.hpp"
#include "qkv/score.hpp"
#include "qkv/scoring.hpp"
#include "qkv/sdpa.hpp"
#include "qkv/softmax.hpp"
#include "qkv/tensor_view.hpp"
