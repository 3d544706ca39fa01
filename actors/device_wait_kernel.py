"""The device wait's kernel (actors/device_wait.py): a layer's mailbox layout in
page-locked memory, and the CUDA source of the wait that publishes a layer's routing,
makes the listed copies while the host reads, and outputs the host's slots."""

from __future__ import annotations

# A layer's mailbox, in int32 words: [published seq, answered seq, ids, extra, copies],
# its ids, the strategy's ranking (extra), the answered slots, then the copies the answer
# asks for (int64 triples: device address, host address, bytes). Word 0 of the first block
# is the aborted token's seq, word 1 the waits that timed out, word 2 the token's seq (read
# by its kernels as they start: the graph's inputs stay the same from token to token).
WORDS = 8192
SEQ_WORD = 2
IDS_AT, MAX_IDS = 8, 128
EXTRA_AT, MAX_EXTRA = IDS_AT + MAX_IDS, 640
SLOTS_AT = EXTRA_AT + MAX_EXTRA  # MAX_IDS of them: 776 + 128 <= 1024
COPIES_AT, MAX_COPIES = 1024, 1024  # 6 words each: 1024 + 6144 <= 8192
# The GPU's clock (%globaltimer, ns) at three points of a layer's wait, as int64: published,
# the answer seen, the lead's end; then its last look that found no answer (how late it
# can have seen the answer). Where the waited token's time goes on the GPU's side: its
# work between two layers against the host's delay.
TIMES = 4
TIMES_AT = COPIES_AT + 6 * MAX_COPIES  # 4 int64: 7168 + 8 <= 8192
Copy = tuple[int, int, int]  # (device address, host address, bytes), as actors/cuda_direct.py
# The wait's grid: 128 blocks are resident at once on an H200 (132 SMs). Block 0 leads and
# waits on no other block, so where fewer fit, the rest start later and still make their
# share of the copies before the kernel ends (slower, never stuck).
BLOCKS, THREADS = 128, 256

# A grid: block 0's thread 0 publishes and watches the mailbox and decides (answered,
# given up), the other blocks follow its decision through `ctl` (device memory, not the
# host's: one poller crosses PCIe); while the host has not answered, every thread of the
# other blocks makes the copies already listed (the reads that finished meanwhile: the GPU
# waits anyway), then the rest once it has. One block alone pulled 5.7 GB/s (session 22: a
# block's 512 loads in flight are latency-bound); the grid's are not. Block 0 makes none:
# when it did, its last look that found no answer came 0.83-0.97 ms before the one that
# found it (its copies and its reads of the host's words queued behind the grid's), and
# the host waited 1.4 ms for a layer the GPU took 0.6 ms over; watching only, 0.56-0.58 ms
# and +3-8 % (H200, session 25). The copies are made before the kernel ends, so before any
# kernel that reads the slots.
SOURCE = """
    volatile int* box = reinterpret_cast<volatile int*>(static_cast<uintptr_t>(mbox[0]));
    volatile int* c = ctl;  // [decision, copies listed], zeroed by the launch
    const bool lead = blockIdx.x == 0;
    // The token's seq: the lead's thread alone uses it, and reads it from the host once
    // (every thread of the grid reading it cost ~1 ms of PCIe reads a layer: session 26).
    const int seq = lead && threadIdx.x == 0 ? box[SEQ_WORD] : 0;
    const int row = meta[0], n = meta[1], m = meta[2];
    const unsigned long long timeout_ns = 1000000ull * (unsigned long long)meta[3];
    volatile int* r = box + (row + 1) * WORDS;
    volatile unsigned long long* times = reinterpret_cast<volatile unsigned long long*>(r + TIMES_AT);
    __shared__ int state, count;  // state: 0 waiting, 1 answered, 2 given up
    __shared__ long long entries[3 * MAX_COPIES];  // 24 KiB: the copies' list
    if (threadIdx.x == 0) {
        state = 0;
        if (lead) {
            for (int i = 0; i < n; ++i) r[IDS_AT + i] = ids[i];
            for (int i = 0; i < m; ++i) r[EXTRA_AT + i] = extra[i];
            if (box[0] != seq) {  // else the host gave this token up already
                r[2] = n; r[3] = m;
                unsigned long long now;
                asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
                times[0] = now; times[1] = 0; times[2] = 0; times[3] = 0;
                __threadfence_system();
                r[0] = seq;
                __threadfence_system();
            }
        }
    }
    __syncthreads();
    // Block 0 only watches the mailbox; the other blocks make the copies.
    const unsigned long long tid = (blockIdx.x - 1) * (unsigned long long)blockDim.x + threadIdx.x;
    const unsigned long long step = (gridDim.x - 1) * (unsigned long long)blockDim.x;
    int done = 0, s = 0;
    unsigned long long t0, t, looked = 0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    while (true) {
        if (threadIdx.x == 0) {
            if (lead) {
                int d = 0;
                // An abort seen after the answer is still an answer (the host answers first).
                if (box[0] == seq) d = r[1] == seq ? 1 : 2;
                else if (r[1] == seq) d = 1;  // the count read after it is final
                else {
                    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
                    looked = t;
                    if (t - t0 > timeout_ns) { box[0] = seq; box[1] += 1; d = 2; }
                }
                __threadfence_system();
                const int listed = r[4];
                c[1] = listed;
                __threadfence();
                if (d) c[0] = d;  // after the count: a follower that sees it reads the final count
                if (d == 1) { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); times[1] = t; }
                state = d; count = listed;
            } else {
                const int d = c[0];
                __threadfence();
                state = d; count = c[1];
            }
        }
        __syncthreads();
        s = state;
        const int upto = count;
        __syncthreads();  // every thread has read them before thread 0 may change them
        if (s == 2) break;
        if (lead) done = upto;
        if (upto > done) {  // the entries listed since the last look, read from the host once
            volatile const long long* listed = reinterpret_cast<volatile const long long*>(r + COPIES_AT);
            for (int i = 3 * done + threadIdx.x; i < 3 * upto; i += blockDim.x) entries[i] = listed[i];
            __syncthreads();
            for (; done < upto; ++done) copy_entry(entries, done, tid, step);
        }
        if (s == 1) break;
        if (threadIdx.x == 0) __nanosleep(lead ? 256 : 1024);
    }
    if (lead && threadIdx.x == 0)
        for (int i = 0; i < n; ++i) slots[i] = s == 1 ? r[SLOTS_AT + i] : -1;
    // The lead's end: the other blocks end once their last copies are made, so the copies
    // after an answer fall in the gap to the next layer's publication, not the tail.
    if (lead && threadIdx.x == 0 && s == 1) {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        times[2] = t; times[3] = looked;
    }
"""

HEADER = f"""
#define WORDS {WORDS}
#define SEQ_WORD {SEQ_WORD}
#define IDS_AT {IDS_AT}
#define EXTRA_AT {EXTRA_AT}
#define SLOTS_AT {SLOTS_AT}
#define COPIES_AT {COPIES_AT}
#define MAX_COPIES {MAX_COPIES}
#define TIMES_AT {TIMES_AT}

// Copy entry `e` of a list (device address, host address, bytes) held in the block's shared
// memory, thread `tid` of `step`: 16 bytes a load where all is aligned, the host's bytes
// read past the caches. (Every thread reading the list from the host's memory itself cost
// a PCIe round trip per thread per entry: 1.0 GB/s for a grid's copies, session 22.)
__device__ inline void copy_entry(const long long* copies, int e, unsigned long long tid, unsigned long long step) {{
    char* dst = reinterpret_cast<char*>(static_cast<uintptr_t>(copies[3 * e]));
    const char* src = reinterpret_cast<const char*>(static_cast<uintptr_t>(copies[3 * e + 1]));
    const unsigned long long bytes = copies[3 * e + 2];
    if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes) & 15) == 0) {{
        for (unsigned long long i = tid; i < bytes / 16; i += step)
            reinterpret_cast<uint4*>(dst)[i] = __ldcv(reinterpret_cast<const uint4*>(src) + i);
    }} else {{
        for (unsigned long long i = tid; i < bytes; i += step)
            dst[i] = reinterpret_cast<volatile const char*>(src)[i];
    }}
}}
"""
