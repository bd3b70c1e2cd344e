from launcher.serve import main

main()
