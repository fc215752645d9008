/*
 * tokenizer_testlib.h — what test_tokenizer.c and the fuzz harness tests/fuzz/fuzz_tokenizer.c share to write
 * tokenizer files by hand: `byte_symbol`, GPT-2's byte-to-unicode table (the printable bytes stand for themselves,
 * the others for 256 + their rank among the unprintable ones), written out independently of lib/base/tokenizer.c's own.
 */
#ifndef AMP_TOKENIZER_TESTLIB_H
#define AMP_TOKENIZER_TESTLIB_H

#include <stdbool.h>

/* GPT-2's byte-to-unicode symbol of byte b (0..255). */
static inline unsigned byte_symbol(int b)
{
    int n = 0;
    for (int c = 0; c < 256; c++) {
        bool printable = (c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF);
        if (c == b)
            return printable ? (unsigned)c : 256u + (unsigned)n;
        n += !printable;
    }
    return 0;
}

#endif
