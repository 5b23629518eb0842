// llama_decode with its C++ exceptions caught (backend/llama/guarded_decode.rs).
//
// llama.cpp's llama_decode lets exceptions out: a decode after a change of the context's graph
// (a sampler chain attached with `llama_set_sampler`, another LoRA adapter set) reserves the
// compute graph again first, and a failed allocation there throws std::runtime_error ("failed
// to allocate compute pp buffers"). Rust cannot catch a foreign exception: the process aborts.
// Here it is caught and its message handed back (a throw from the reserve comes before the cache
// took any cell of the batch; one from later in the decode may leave some).

#include <cstdint>
#include <cstring>
#include <exception>

#include "llama.h"

namespace {

void copy_message(char * out, size_t out_len, const char * message) {
    if (out == nullptr || out_len == 0) {
        return;
    }
    std::strncpy(out, message, out_len - 1);
    out[out_len - 1] = '\0';
}

}  // namespace

// What llama_decode returns, or 0 with `*threw` set to 1 and the exception's message in `what`
// (at most `what_len` bytes with its terminating NUL) when it threw.
extern "C" int32_t llamarunner_guarded_decode(llama_context * ctx, llama_batch batch, char * what,
                                              size_t what_len, int32_t * threw) noexcept {
    *threw = 0;
    try {
        return llama_decode(ctx, batch);
    } catch (const std::exception & e) {
        copy_message(what, what_len, e.what());
    } catch (...) {
        copy_message(what, what_len, "an exception that is not a std::exception");
    }
    *threw = 1;
    return 0;
}
