// C interface of the emulation's stream holds (emulate.cu), part of the same
// library as wb_cuda.h. The recording backend calls both by address when it
// paces an NCCL collective (extensions/telemetry/emulation.cpp).

#pragma once

#include <stdint.h>

#include "wb_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

// Writes the GPU clock (%globaltimer, ns) into a slot when `stream` reaches
// this point; returns the slot (>= 0), or minus a cudaError_t.
WB_API int64_t wb_emulate_stamp(int device, uintptr_t stream);

// Holds `stream` until the GPU clock reads
//     max(slot's stamp, clock when the hold starts - real_ns) + target_ns,
// i.e. the emulated completion of a collective stamped into `slot` and
// ordered before this point on `stream`. The kernel sleeps between clock
// reads (__nanosleep) on one thread: no host thread waits.
WB_API int wb_emulate_hold(int device, uintptr_t stream, int64_t slot, int64_t target_ns, int64_t real_ns);

#ifdef __cplusplus
}
#endif
