// caravan: command-line entry point (placeholder while the CLI is written).
int main() { return 0; }
