/* Does this C compiler keep an AMX tile configuration that is written to a local and then loaded?

    gcc -O2 -mamx-tile bench/amx_tilecfg.c -o /tmp/amx_tilecfg && /tmp/amx_tilecfg
    clang -O2 -mamx-tile bench/amx_tilecfg.c -o /tmp/amx_tilecfg && /tmp/amx_tilecfg

Linux, x86-64 with AMX only. configure() fills a 64-byte tile configuration (palette 1, tile 0:
16 rows of 64 bytes) in a local and loads it with _tile_loadconfig; nothing reads the local
afterwards, as in ggml's AMX matmul. GCC 12's intrinsic tells the compiler that ldtilecfg reads
only the first 8 bytes of the configuration, so -O2 may drop the stores of the shapes (bytes 16 on)
as dead: the loaded configuration then has palette 1 and tile 0 is 0 x 0, and the first tileloadd
raises #UD, which Linux delivers as SIGILL. The program prints the configuration that was loaded
(read back with sttilecfg) and exits 0 when the shapes arrived, 1 when they did not, before any
tile instruction that would fault. README, "The llama.cpp extra on x86", says what this means for
llama.cpp builds. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

struct tile_config {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* noinline: the local's lifetime ends here, right after the load */
__attribute__((noinline)) static void configure(void) {
    _Alignas(64) struct tile_config cfg = {0};
    cfg.palette = 1;
    cfg.rows[0] = 16;
    cfg.colsb[0] = 64;
    _tile_loadconfig(&cfg);
}

int main(void) {
    /* the kernel grants AMX tile data per process, on request */
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) {
        perror("arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)");
        return 2;
    }
    configure();
    _Alignas(64) struct tile_config loaded;
    _tile_storeconfig(&loaded);
    int kept = loaded.rows[0] == 16 && loaded.colsb[0] == 64;
    printf("loaded tile configuration: palette %u, tile 0 %u rows x %u bytes: %s\n", loaded.palette,
           loaded.rows[0], loaded.colsb[0],
           kept ? "kept" : "the compiler dropped the shapes (a tile instruction would raise SIGILL)");
    return kept ? 0 : 1;
}
